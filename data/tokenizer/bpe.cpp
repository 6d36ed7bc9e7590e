#include "data/tokenizer/bpe.h"

#include <limits>
#include <queue>
#include <stdexcept>

namespace nnstrain::tok {

namespace {
constexpr uint32_t kNoMerge = std::numeric_limits<uint32_t>::max();
// Below this many bytes a piece is merged by scanning (cheap for the short pieces
// text is made of); longer ones use a heap (no quadratic time on a 1 MB run).
constexpr size_t kShortPiece = 48;
}  // namespace

bool BpeModel::add_token(std::string_view bytes, int32_t id) {
  if (id < 0 || vocab_.find(bytes) || has_id(id)) return false;
  vocab_.put(bytes, id);
  if (static_cast<size_t>(id) >= id_bytes_.size()) {
    id_bytes_.resize(id + 1);
    present_.resize(id + 1, false);
  }
  id_bytes_[id] = std::string(bytes);
  present_[id] = true;
  if (bytes.size() == 1) {
    byte_ids_[static_cast<unsigned char>(bytes[0])] = id;
    byte_set_[static_cast<unsigned char>(bytes[0])] = true;
  }
  return true;
}

void BpeModel::add_merge(int32_t a, int32_t b, uint32_t rank, int32_t merged) {
  merges_.put((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b),
              BpeMerge{rank, merged});
}

int BpeModel::missing_byte() const {
  for (int b = 0; b < 256; ++b)
    if (!byte_set_[b]) return b;
  return -1;
}

void BpeModel::encode(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (ignore_merges_) {
    if (const int32_t* id = vocab_.find(piece)) {
      out.push_back(*id);
      return;
    }
  }
  if (piece.size() <= kShortPiece) encode_short(piece, out);
  else encode_long(piece, out);
}

void BpeModel::encode_short(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n0 = piece.size();
  int32_t ids[kShortPiece];
  uint32_t rank[kShortPiece];  // rank[i]: merge of (ids[i], ids[i+1])
  int32_t next_id[kShortPiece];
  size_t n = n0;
  for (size_t i = 0; i < n; ++i) ids[i] = byte_ids_[static_cast<unsigned char>(piece[i])];
  auto set_rank = [&](size_t i) {
    const BpeMerge* m = merge(ids[i], ids[i + 1]);
    rank[i] = m ? m->rank : kNoMerge;
    next_id[i] = m ? m->id : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) set_rank(i);
  while (n > 1) {
    size_t best = 0;
    uint32_t best_rank = kNoMerge;
    for (size_t i = 0; i + 1 < n; ++i)
      if (rank[i] < best_rank) {
        best_rank = rank[i];
        best = i;
      }
    if (best_rank == kNoMerge) break;
    ids[best] = next_id[best];
    for (size_t i = best + 1; i + 1 < n; ++i) {
      ids[i] = ids[i + 1];
      rank[i] = rank[i + 1];
      next_id[i] = next_id[i + 1];
    }
    --n;
    if (best > 0) set_rank(best - 1);
    if (best + 1 < n) set_rank(best);
  }
  out.insert(out.end(), ids, ids + n);
}

void BpeModel::encode_long(std::string_view piece, std::vector<int32_t>& out) const {
  struct Sym {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  struct Cand {
    uint32_t rank;
    int32_t pos;
    int32_t id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  if (piece.size() > kMaxPiece) throw std::length_error("BPE: a piece of over 2^31 - 1 bytes");
  const int32_t n = static_cast<int32_t>(piece.size());
  std::vector<Sym> s(n);
  for (int32_t i = 0; i < n; ++i) s[i] = {byte_ids_[static_cast<unsigned char>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int32_t pos) {
    const int32_t nx = s[pos].next;
    if (nx < 0) return;
    if (const BpeMerge* m = merge(s[pos].id, s[nx].id)) heap.push({m->rank, pos, m->id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& a = s[c.pos];
    if (!a.alive || a.next < 0) continue;
    const BpeMerge* m = merge(a.id, s[a.next].id);
    if (!m || m->id != c.id) continue;  // stale: the pair changed since it was queued
    Sym& b = s[a.next];
    a.id = c.id;
    b.alive = false;
    a.next = b.next;
    if (b.next >= 0) s[b.next].prev = c.pos;
    if (a.prev >= 0) push(a.prev);
    push(c.pos);
  }
  for (int32_t i = 0; i >= 0 && i < n; i = s[i].next) out.push_back(s[i].id);
}

}  // namespace nnstrain::tok
