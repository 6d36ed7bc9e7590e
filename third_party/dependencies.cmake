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
if(NNSTRAIN_BUILD_TESTS AND NOT NNSTRAIN_FUZZ)
  find_package(Catch2 2 REQUIRED)
endif()

# CUDA: one binary for CPU and GPU machines. NNSTRAIN_WITH_CUDA=AUTO (the
# default) compiles and links nnstrain's CUDA and NCCL code whenever the
# LibTorch it builds against has CUDA (the PyPI wheel does) and a CUDA toolkit
# is found; the binary still trains on CPU where no GPU is present. Without a
# toolkit it says so in one line and builds the CPU-only binary. ON requires
# CUDA, OFF never compiles it.
get_property(_nnstrain_cuda_type CACHE NNSTRAIN_WITH_CUDA PROPERTY TYPE)
if(_nnstrain_cuda_type STREQUAL "BOOL")  # a build folder from when this was an option, default OFF
  unset(NNSTRAIN_WITH_CUDA CACHE)
endif()
set(NNSTRAIN_WITH_CUDA AUTO CACHE STRING "Build nnstrain's CUDA/NCCL code: AUTO, ON or OFF")
set_property(CACHE NNSTRAIN_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(_nnstrain_torch_cuda_lib "")
foreach(prefix ${CMAKE_PREFIX_PATH})
  # CMAKE_PREFIX_PATH holds torch.utils.cmake_prefix_path = <torch>/share/cmake
  foreach(lib "${prefix}/../../lib/libtorch_cuda.so" "${prefix}/lib/libtorch_cuda.so")
    if(NOT _nnstrain_torch_cuda_lib AND EXISTS "${lib}")
      get_filename_component(_nnstrain_torch_cuda_lib "${lib}" ABSOLUTE)
    endif()
  endforeach()
endforeach()
set(NNSTRAIN_CUDA OFF)
if(_nnstrain_torch_cuda_lib)
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND AND NOT NNSTRAIN_WITH_CUDA STREQUAL "OFF")
    set(NNSTRAIN_CUDA ON)
  elseif(NNSTRAIN_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "nnstrain: NNSTRAIN_WITH_CUDA=ON but no CUDA toolkit was found (set CUDAToolkit_ROOT or put nvcc on PATH)")
  endif()
  if(NOT CUDAToolkit_FOUND)
    # TorchConfig insists on a toolkit when LibTorch has CUDA; its one use of
    # one here is the torch::cudart target, which an empty stand-in satisfies
    # (the CUDA runtime libraries come with the wheel).
    add_library(torch::cudart INTERFACE IMPORTED)
  endif()
elseif(NNSTRAIN_WITH_CUDA STREQUAL "ON")
  message(FATAL_ERROR "nnstrain: NNSTRAIN_WITH_CUDA=ON but this LibTorch has no CUDA (no libtorch_cuda.so)")
endif()
if(NNSTRAIN_FUZZ)  # the fuzz build (tests/fuzz) covers torch-free code only
  message(STATUS "nnstrain: fuzz build: nnstrain_base and the libFuzzer targets, no LibTorch")
else()
find_package(Torch REQUIRED)
if(NNSTRAIN_CUDA)
  # NCCL's header: the one of the NCCL the wheel ships (nvidia/nccl), else the toolkit's.
  find_path(NNSTRAIN_NCCL_INCLUDE_DIR nccl.h
            HINTS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS})
  if(NOT NNSTRAIN_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "nnstrain: CUDA toolkit found but no nccl.h (install NCCL or set NNSTRAIN_NCCL_INCLUDE_DIR)")
  endif()
  message(STATUS "nnstrain: CUDA on: LibTorch ${Torch_VERSION} has CUDA, toolkit ${CUDAToolkit_VERSION} at "
                 "${CUDAToolkit_BIN_DIR}: building the CUDA and NCCL code (the binary still runs on CPU)")
elseif(NNSTRAIN_WITH_CUDA STREQUAL "OFF")
  message(STATUS "nnstrain: CUDA off (NNSTRAIN_WITH_CUDA=OFF): building the CPU-only binary")
elseif(_nnstrain_torch_cuda_lib)
  message(STATUS "nnstrain: CUDA off: no CUDA toolkit found (set CUDAToolkit_ROOT to use one): building the CPU-only binary")
else()
  message(STATUS "nnstrain: CUDA off: this LibTorch has no CUDA: building the CPU-only binary")
endif()
endif()

# yaml-cpp's Debian target name changed across versions.
if(TARGET yaml-cpp::yaml-cpp)
  set(NNSTRAIN_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(NNSTRAIN_YAML_TARGET yaml-cpp)
endif()
