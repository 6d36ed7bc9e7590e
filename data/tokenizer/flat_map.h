// Open-addressing hash maps for the encoder's hot loop: byte strings -> a value
// (keys copied into one arena), and 64-bit keys -> a value. Insert and find only.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace nnstrain::tok {

inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ (n * 0xFF51AFD7ED558CCDULL);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * 0x94D049BB133111EBULL;
  }
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ULL;
  return h ^ (h >> 32);
}

template <class V>
class StringMap {
 public:
  size_t size() const { return count_; }
  void clear() {
    slots_.assign(slots_.size(), Slot{});
    arena_.clear();
    count_ = 0;
  }
  size_t arena_bytes() const { return arena_.size(); }
  void reserve(size_t n) {
    while ((n + 1) * 4 >= slots_.size() * 3) grow();
  }

  const V* find(std::string_view key) const {
    if (slots_.empty()) return nullptr;
    const uint64_t h = hash_bytes(key.data(), key.size());
    const uint32_t tag = static_cast<uint32_t>(h) | 1;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.tag == 0) return nullptr;
      if (s.tag == tag && s.len == key.size() && std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0)
        return &s.value;
    }
  }
  // Inserts or overwrites.
  void put(std::string_view key, const V& value) {
    if ((count_ + 1) * 4 >= slots_.size() * 3) grow();
    const uint64_t h = hash_bytes(key.data(), key.size());
    const uint32_t tag = static_cast<uint32_t>(h) | 1;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.tag == 0) {
        s.tag = tag;
        s.off = arena_.size();
        s.len = static_cast<uint32_t>(key.size());
        s.value = value;
        arena_.append(key.data(), key.size());
        ++count_;
        return;
      }
      if (s.tag == tag && s.len == key.size() && std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0) {
        s.value = value;
        return;
      }
    }
  }

 private:
  struct Slot {
    uint32_t tag = 0;  // 0: empty
    uint32_t len = 0;
    uint64_t off = 0;
    V value{};
  };
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.empty() ? 64 : old.size() * 2, Slot{});
    mask_ = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.tag == 0) continue;
      const uint64_t h = hash_bytes(arena_.data() + s.off, s.len);
      size_t i = h & mask_;
      while (slots_[i].tag != 0) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  std::string arena_;
  size_t mask_ = 0;
  size_t count_ = 0;
};

// Keys must not be ~0 (the empty slot's mark): the encoder's keys are two ids
// (below 2^31) packed in 64 bits. A slot is the key and the value (16 bytes for
// BPE's merges: four to a cache line), at most 60% full (most lookups are of pairs
// that are no merge, and a miss probes until an empty slot).
template <class V>
class U64Map {
 public:
  static constexpr uint64_t kEmpty = ~0ULL;
  const V* find(uint64_t key) const {
    if (slots_.empty()) return nullptr;
    for (size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s.value;
      if (s.key == kEmpty) return nullptr;
    }
  }
  void put(uint64_t key, const V& value) {
    if ((count_ + 1) * 5 >= slots_.size() * 3) grow();
    for (size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == kEmpty) {
        s = Slot{key, value};
        ++count_;
        return;
      }
      if (s.key == key) {
        s.value = value;
        return;
      }
    }
  }
  size_t size() const { return count_; }
  void reserve(size_t n) {
    while ((n + 1) * 5 >= slots_.size() * 3) grow();
  }

 private:
  struct Slot {
    uint64_t key = kEmpty;
    V value{};
  };
  static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    return x ^ (x >> 29);
  }
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.empty() ? 64 : old.size() * 2, Slot{});
    mask_ = slots_.size() - 1;
    for (const Slot& s : old)
      if (s.key != kEmpty) {
        size_t i = mix(s.key) & mask_;
        while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
        slots_[i] = s;
      }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t count_ = 0;
};

}  // namespace nnstrain::tok
