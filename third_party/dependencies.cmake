# How nnstrain finds its external dependencies. All come from find_package:
#   LibTorch 2.11   from the PyPI torch wheel (CMAKE_PREFIX_PATH = torch.utils.cmake_prefix_path,
#                   set by scripts/setup.sh)
#   yaml-cpp, nlohmann_json, spdlog (+fmt), Catch2 v2, cxxopts: Debian packages
#                   (libyaml-cpp-dev nlohmann-json3-dev libspdlog-dev catch2 libcxxopts-dev)

find_package(yaml-cpp REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(spdlog REQUIRED)
find_package(cxxopts REQUIRED)
find_package(Threads REQUIRED)
if(NNSTRAIN_BUILD_TESTS)
  find_package(Catch2 2 REQUIRED)
endif()

# The torch wheel ships CUDA libraries; TorchConfig then wants a CUDA toolkit.
# Use it when present (CUDA code compiles and links even without a GPU), otherwise
# fall back to a CPU-only build of nnstrain against the same wheel.
if(NOT NNSTRAIN_WITH_CUDA)
  set(USE_CUDA OFF CACHE BOOL "" FORCE)
endif()
find_package(Torch REQUIRED)

# yaml-cpp's Debian target name changed across versions.
if(TARGET yaml-cpp::yaml-cpp)
  set(NNSTRAIN_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(NNSTRAIN_YAML_TARGET yaml-cpp)
endif()
