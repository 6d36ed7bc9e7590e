#include "trainer/eval/evaluator.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <numeric>

#include "data/chat/jinja_value.h"
#include "models/common/kv_cache.h"
#include "models/model.h"

namespace nnstrain::eval {

namespace {

using Clock = std::chrono::steady_clock;

struct LlRequest {
  std::vector<int64_t> ctx, cont;
  const DocRequests* doc = nullptr;
};

// A progress bar on rank 0's terminal, redrawn at most every half second.
class Progress {
 public:
  Progress(bool on, std::string label, int64_t total)
      : on_(on && isatty(2)), label_(std::move(label)), total_(total), last_(Clock::now() - std::chrono::seconds(1)) {}
  void add(int64_t n) {
    done_ += n;
    if (!on_) return;
    const auto now = Clock::now();
    if (now - last_ < std::chrono::milliseconds(500) && done_ < total_) return;
    last_ = now;
    const int width = 30, fill = total_ ? int(width * done_ / total_) : width;
    std::cerr << "\r  " << label_ << " [" << std::string(fill, '#') << std::string(width - fill, ' ') << "] " << done_
              << "/" << total_ << std::flush;
  }
  ~Progress() {
    if (on_) std::cerr << "\r" << std::string(label_.size() + 60, ' ') << "\r" << std::flush;
  }

 private:
  bool on_;
  std::string label_;
  int64_t total_, done_ = 0;
  Clock::time_point last_;
};

bool py_space_byte_run(const std::string& s, size_t& cut) {
  // The start of the context's trailing whitespace (Python's rstrip()).
  const auto offs = jinja::utf8_offsets(s);
  cut = s.size();
  for (size_t k = offs.size() - 1; k > 0; --k) {
    const auto [cp, len] = jinja::utf8_decode(s, offs[k - 1]);
    (void)len;
    if (!jinja::is_py_space(cp)) break;
    cut = offs[k - 1];
  }
  return cut < s.size();
}

// The harness's _encode_pair (and its empty-context rule).
void encode_pair(const TextCodec& codec, std::string context, std::string continuation, LlRequest& r) {
  if (context.empty()) {
    auto cont = codec.encode(continuation, /*add_special=*/false);
    if (!cont.empty() && cont.front() == codec.prefix) {
      r.ctx = {cont.front()};
      r.cont.assign(cont.begin() + 1, cont.end());
    } else {
      r.ctx = {codec.prefix};
      r.cont = std::move(cont);
    }
    return;
  }
  size_t cut = 0;
  if (py_space_byte_run(context, cut)) {
    continuation = context.substr(cut) + continuation;
    context = context.substr(0, cut);
  }
  const auto whole = codec.encode(context + continuation);
  r.ctx = codec.encode(context);
  r.cont.assign(whole.begin() + std::min(whole.size(), r.ctx.size()), whole.end());
}

// What a batch's logits reduce to, from logits() here or the pipeline's last stage.
at::Tensor forward_reduced(Backend& be, const at::Tensor& x, const Backend::Reduce& reduce, const at::Tensor& like) {
  if (be.staged_forward) return be.staged_forward(x, reduce, like);
  return reduce(be.model->logits(x));
}

struct Scored {
  double ll = 0;
  bool greedy = false;
};

// Every request's (sum of log-probabilities, greedy), this rank's share
// computed, the others' summed in from their ranks.
std::vector<Scored> score(std::vector<LlRequest>& reqs, Backend& be, int64_t batch, int64_t max_len,
                          TaskResult& res, const std::string& label) {
  const size_t n = reqs.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Longest first (the harness's order), so a batch holds similar lengths.
  auto total = [&](size_t i) { return reqs[i].ctx.size() + reqs[i].cont.size(); };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (total(a) != total(b)) return total(a) > total(b);
    std::vector<int64_t> ta = reqs[a].ctx, tb = reqs[b].ctx;
    ta.insert(ta.end(), reqs[a].cont.begin(), reqs[a].cont.end());
    tb.insert(tb.end(), reqs[b].cont.begin(), reqs[b].cont.end());
    return ta < tb;
  });
  for (const auto& r : reqs) {
    if (r.cont.empty()) throw TaskError(r.doc->where + ": the continuation encodes to no tokens");
    if (int64_t(r.cont.size()) > max_len)
      throw TaskError(r.doc->where + ": the continuation's " + std::to_string(r.cont.size()) +
                      " tokens exceed the model's context of " + std::to_string(max_len));
    if (int64_t(r.ctx.size() + r.cont.size()) > max_len + 1) {
      if (res.truncated++ == 0) res.first_truncated = r.doc->where;
    }
  }
  std::vector<size_t> mine;
  for (size_t p = be.dp_rank; p < n; p += be.dp_size) mine.push_back(order[p]);
  auto out = torch::zeros({int64_t(n), 2}, torch::kFloat64);
  auto acc = out.accessor<double, 2>();
  Progress bar(be.progress, label, int64_t(mine.size()));
  c10::InferenceMode inference(be.inference_mode);
  torch::NoGradGuard no_grad;
  for (size_t b0 = 0; b0 < mine.size(); b0 += batch) {
    const size_t b1 = std::min(mine.size(), b0 + size_t(batch));
    std::vector<std::vector<int64_t>> inps;
    int64_t width = 0;
    for (size_t k = b0; k < b1; ++k) {
      const auto& r = reqs[mine[k]];
      std::vector<int64_t> all = r.ctx;
      all.insert(all.end(), r.cont.begin(), r.cont.end());
      const size_t keep = std::min(all.size(), size_t(max_len + 1));
      std::vector<int64_t> inp(all.end() - keep, all.end() - 1);
      width = std::max<int64_t>(width, inp.size());
      inps.push_back(std::move(inp));
    }
    width = (width + be.seq_multiple - 1) / be.seq_multiple * be.seq_multiple;
    auto x = torch::zeros({int64_t(inps.size()), width}, torch::kLong);
    for (size_t i = 0; i < inps.size(); ++i)
      x[i].narrow(0, 0, int64_t(inps[i].size())).copy_(torch::tensor(inps[i], torch::kLong));
    if (be.before_forward) be.before_forward();
    // Per row: the continuation's summed log-probability (fp32, then as a
    // double) and whether it is the greedy one: [rows, 2].
    auto reduce = [&](const at::Tensor& logits) {
      std::vector<at::Tensor> rows;
      for (size_t i = 0; i < inps.size(); ++i) {
        const auto& r = reqs[mine[b0 + i]];
        const int64_t inplen = int64_t(inps[i].size()), contlen = int64_t(r.cont.size());
        const auto lp = logits[i].narrow(0, inplen - contlen, contlen).to(torch::kFloat32).log_softmax(-1);
        const auto cont = torch::tensor(r.cont, torch::kLong).to(lp.device());
        const auto picked = lp.gather(1, cont.unsqueeze(1)).squeeze(1);
        rows.push_back(torch::stack({picked.sum().to(torch::kFloat64), lp.argmax(-1).eq(cont).all().to(torch::kFloat64)}));
      }
      return torch::stack(rows);
    };
    const auto like = torch::zeros({int64_t(inps.size()), 2}, torch::TensorOptions().dtype(torch::kFloat64).device(be.device));
    const auto got = forward_reduced(be, x.to(be.device), reduce, like).cpu();
    const auto g = got.accessor<double, 2>();
    for (size_t i = 0; i < inps.size(); ++i) {
      acc[mine[b0 + i]][0] = g[i][0];
      acc[mine[b0 + i]][1] = g[i][1] > 0.5 ? 1.0 : 0.0;
    }
    bar.add(int64_t(inps.size()));
  }
  if (be.after_forwards) be.after_forwards();
  if (be.dp_sum) {
    auto dev = out.to(be.device);
    be.dp_sum(dev);
    out = dev.cpu();
    acc = out.accessor<double, 2>();
  }
  std::vector<Scored> scores(n);
  for (size_t i = 0; i < n; ++i) scores[i] = {acc[i][0], acc[i][1] > 0.5};
  return scores;
}

// get_rolling_token_windows(context_len=1) made disjoint: every token predicted once.
void rolling_windows(const std::vector<int64_t>& toks, int64_t prefix, int64_t L, const DocRequests* doc,
                     std::vector<LlRequest>& out) {
  const int64_t n = int64_t(toks.size());
  if (n == 0) return;
  const int64_t first = std::min(L, n);
  LlRequest r;
  r.doc = doc;
  r.ctx = {prefix};
  r.cont.assign(toks.begin(), toks.begin() + first);
  out.push_back(r);
  for (int64_t predicted = first; predicted < n;) {
    const int64_t len = std::min(n - predicted, L), end = predicted + len;
    LlRequest w;
    w.doc = doc;
    // context tokens[end - L - 1, end - 1), cut to the part before the predictions
    w.ctx.assign(toks.begin() + (end - L - 1), toks.begin() + (end - L - 1) + (L - (len - 1)));
    w.cont.assign(toks.begin() + (end - len), toks.begin() + end);
    out.push_back(std::move(w));
    predicted += len;
  }
}

std::string generate_one(const Task& t, const DocRequests& d, const TextCodec& codec, Backend& be, int64_t max_len,
                         TaskResult& res) {
  auto& model = *be.model;
  auto ctx = codec.encode(d.context);
  const int64_t room = max_len - t.max_gen_toks;
  if (room <= 0)
    throw TaskError(t.file + ": max_gen_toks " + std::to_string(t.max_gen_toks) + " leaves no room for a context in the model's " +
                    std::to_string(max_len) + " tokens");
  if (int64_t(ctx.size()) > room) {
    if (res.truncated++ == 0) res.first_truncated = d.where;
    ctx.erase(ctx.begin(), ctx.end() - room);
  }
  if (ctx.empty()) ctx = {codec.prefix};
  std::vector<int64_t> seq = ctx, gen;
  c10::InferenceMode inference(be.inference_mode);
  torch::NoGradGuard no_grad;
  models::common::KvCache cache(int64_t(ctx.size()) + t.max_gen_toks);
  std::vector<std::string> stops = t.until;
  if (codec.eos) {
    const auto e = codec.decode({*codec.eos}, false);
    if (std::find(stops.begin(), stops.end(), e) == stops.end()) stops.push_back(e);
  }
  auto ids = [&](const std::vector<int64_t>& v, size_t from) {
    std::vector<int64_t> s(v.begin() + from, v.end());
    return torch::tensor(s, torch::kLong).view({1, -1}).to(be.device);
  };
  for (int64_t step = 0; step < t.max_gen_toks; ++step) {
    if (be.before_forward) be.before_forward();
    int64_t next = 0;
    if (be.kv_cache) {
      next = model.decode_logits(ids(seq, step == 0 ? 0 : seq.size() - 1), cache)[0][-1].argmax().item<int64_t>();
    } else {  // a whole forward per token
      auto x = ids(seq, 0);
      const int64_t T = x.size(1), padded = (T + be.seq_multiple - 1) / be.seq_multiple * be.seq_multiple;
      if (padded > T) x = torch::constant_pad_nd(x, {0, padded - T});
      auto reduce = [T](const at::Tensor& logits) { return logits[0][T - 1].argmax(); };
      const auto like = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(be.device));
      next = forward_reduced(be, x, reduce, like).cpu().item<int64_t>();
    }
    seq.push_back(next);
    gen.push_back(next);
    if (codec.eos && next == *codec.eos) break;
    const auto text = codec.decode(gen, false);
    bool stop = false;
    for (const auto& s : stops)
      if (!s.empty() && text.find(s) != std::string::npos) stop = true;
    if (stop) break;
  }
  if (be.after_forwards) be.after_forwards();
  std::string s = codec.decode(gen, true);
  for (const auto& term : stops)
    if (!term.empty()) s = s.substr(0, s.find(term));
  return s;
}

// Strings from every data-parallel rank: each fills its own rows of a byte tensor.
std::vector<std::string> gather_strings(std::vector<std::string> mine_or_empty, const std::vector<bool>& is_mine,
                                        Backend& be) {
  if (!be.dp_sum) return mine_or_empty;
  const int64_t n = int64_t(mine_or_empty.size());
  auto lens = torch::zeros({n}, torch::kLong);
  for (int64_t i = 0; i < n; ++i)
    if (is_mine[i]) lens[i] = int64_t(mine_or_empty[i].size());
  auto l = lens.to(be.device);
  be.dp_sum(l);
  lens = l.cpu();
  const int64_t width = std::max<int64_t>(1, lens.max().item<int64_t>());
  auto bytes = torch::zeros({n, width}, torch::kLong);
  for (int64_t i = 0; i < n; ++i)
    if (is_mine[i])
      for (size_t k = 0; k < mine_or_empty[i].size(); ++k) bytes[i][k] = int64_t((unsigned char)mine_or_empty[i][k]);
  auto b = bytes.to(be.device);
  be.dp_sum(b);
  bytes = b.cpu();
  auto acc = bytes.accessor<int64_t, 2>();
  std::vector<std::string> out(n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < lens[i].item<int64_t>(); ++k) out[i] += char(acc[i][k]);
  return out;
}

int64_t argmax(const std::vector<double>& v) {
  return std::max_element(v.begin(), v.end()) - v.begin();  // the first of equal maxima, as numpy
}

}  // namespace

std::vector<TaskResult> evaluate(const std::vector<Task>& tasks, const TextCodec& codec, Backend& be,
                                 const EvalOptions& opts) {
  std::vector<TaskResult> results;
  const int64_t L = be.model->max_seq_len();
  for (const auto& t : tasks) {
    const auto t0 = Clock::now();
    TaskResult res;
    res.name = t.name;
    res.kind = kind_name(t.kind);
    res.file = t.file;
    res.docs = int64_t(t.docs.size());
    std::vector<LlRequest> reqs;
    auto encode_at = [&](const DocRequests& d, auto&& fn) {
      try {
        fn();
      } catch (const TaskError&) {
        throw;
      } catch (const std::exception& e) {
        throw TaskError(d.where + ": " + e.what());
      }
    };
    if (t.kind == Kind::multiple_choice) {
      for (const auto& d : t.docs)
        for (const auto& c : d.continuations) {
          LlRequest r;
          r.doc = &d;
          encode_at(d, [&] { encode_pair(codec, d.context, c, r); });
          reqs.push_back(std::move(r));
        }
      res.requests = int64_t(reqs.size());
      const auto s = score(reqs, be, opts.batch_size, L, res, t.name);
      double acc = 0, acc_norm = 0, acc_bytes = 0;
      size_t k = 0;
      for (const auto& d : t.docs) {
        std::vector<double> lls, by_chars, by_bytes;
        std::vector<bool> greedy;
        for (size_t c = 0; c < d.choices.size(); ++c, ++k) {
          lls.push_back(s[k].ll);
          greedy.push_back(s[k].greedy);
          by_chars.push_back(s[k].ll / double(jinja::utf8_length(d.choices[c])));
          by_bytes.push_back(s[k].ll / double(d.choices[c].size()));
        }
        const int64_t pred = argmax(lls), pred_norm = argmax(by_chars), pred_bytes = argmax(by_bytes);
        acc += pred == d.gold, acc_norm += pred_norm == d.gold, acc_bytes += pred_bytes == d.gold;
        if (opts.per_doc)
          res.per_doc.push_back({{"where", d.where}, {"lls", lls}, {"greedy", greedy}, {"pred", pred},
                                 {"pred_norm", pred_norm}, {"gold", d.gold}});
      }
      const double n = std::max<double>(1, t.docs.size());
      for (const auto& m : t.metrics)
        res.metrics.push_back({m, (m == "acc" ? acc : m == "acc_norm" ? acc_norm : acc_bytes) / n});
    } else if (t.kind == Kind::loglikelihood_rolling) {
      std::vector<size_t> first(t.docs.size() + 1, 0);
      for (size_t i = 0; i < t.docs.size(); ++i) {
        const auto& d = t.docs[i];
        first[i] = reqs.size();
        encode_at(d, [&] { rolling_windows(codec.encode(d.text), codec.prefix, L, &d, reqs); });
      }
      first[t.docs.size()] = reqs.size();
      res.requests = int64_t(reqs.size());
      const auto s = score(reqs, be, opts.batch_size, L, res, t.name);
      double ll = 0, words = 0, bytes = 0;
      for (size_t i = 0; i < t.docs.size(); ++i) {
        double doc_ll = 0;
        for (size_t k = first[i]; k < first[i + 1]; ++k) doc_ll += s[k].ll;
        ll += doc_ll, words += double(t.docs[i].words), bytes += double(t.docs[i].bytes);
        if (opts.per_doc)
          res.per_doc.push_back({{"where", t.docs[i].where}, {"ll", doc_ll}, {"words", t.docs[i].words},
                                 {"bytes", t.docs[i].bytes}, {"windows", first[i + 1] - first[i]}});
      }
      for (const auto& m : t.metrics) {
        const double v = m == "word_perplexity" ? std::exp(-ll / words)
                         : m == "byte_perplexity" ? std::exp(-ll / bytes)
                                                  : -ll / bytes / std::log(2.0);
        res.metrics.push_back({m, v});
      }
    } else {
      const size_t n = t.docs.size();
      std::vector<std::string> generated(n);
      std::vector<bool> is_mine(n, false);
      // Longest contexts first over the ranks, as the harness orders them.
      std::vector<size_t> order(n);
      std::vector<size_t> lens(n);
      for (size_t i = 0; i < n; ++i) lens[i] = t.docs[i].context.size();
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lens[a] > lens[b]; });
      int64_t mine_count = 0;
      for (size_t p = be.dp_rank; p < n; p += be.dp_size) ++mine_count;
      Progress bar(be.progress, t.name, mine_count);
      for (size_t p = be.dp_rank; p < n; p += be.dp_size) {
        const auto& d = t.docs[order[p]];
        encode_at(d, [&] { generated[order[p]] = generate_one(t, d, codec, be, L, res); });
        is_mine[order[p]] = true;
        bar.add(1);
      }
      res.requests = int64_t(n);
      if (be.dp_sum) {
        auto tr = torch::tensor({res.truncated}, torch::kLong).to(be.device);
        be.dp_sum(tr);
        res.truncated = tr.cpu().item<int64_t>();
      }
      generated = gather_strings(generated, is_mine, be);
      double matches = 0;
      for (size_t i = 0; i < n; ++i) {
        const auto filtered = apply_filter(t, generated[i]);
        const bool m = exact_match(t, filtered, t.docs[i].target);
        matches += m;
        if (opts.per_doc)
          res.per_doc.push_back({{"where", t.docs[i].where}, {"generated", generated[i]}, {"filtered", filtered},
                                 {"target", t.docs[i].target}, {"match", m}});
      }
      res.metrics.push_back({"exact_match", matches / std::max<double>(1, n)});
    }
    res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    results.push_back(std::move(res));
  }
  return results;
}

nlohmann::json to_json(const std::vector<TaskResult>& results) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& r : results) {
    nlohmann::json m = nlohmann::json::object();
    for (const auto& [k, v] : r.metrics) m[k] = v;
    nlohmann::json t = {{"kind", r.kind}, {"file", r.file}, {"docs", r.docs}, {"requests", r.requests},
                        {"truncated", r.truncated}, {"seconds", r.seconds}, {"metrics", m}};
    if (r.truncated) t["first_truncated"] = r.first_truncated;
    if (!r.per_doc.empty()) t["per_doc"] = r.per_doc;
    j[r.name] = t;
  }
  return j;
}

}  // namespace nnstrain::eval
