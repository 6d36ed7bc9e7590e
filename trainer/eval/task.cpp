#include "trainer/eval/task.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "data/chat/jinja_lexer.h"
#include "data/chat/jinja_parser.h"
#include "data/chat/jinja_runtime.h"
#include "data/chat/jinja_value.h"
#include "trainer/eval/py_random.h"

namespace fs = std::filesystem;

namespace nnstrain::eval {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::multiple_choice: return "multiple_choice";
    case Kind::loglikelihood_rolling: return "loglikelihood_rolling";
    case Kind::generate_until: return "generate_until";
  }
  return "?";
}

namespace {

using jinja::Value;

struct Doc {
  nlohmann::ordered_json json;
  Value value;
  std::string key;  // canonical text (sorted keys): the harness compares documents as dicts
  std::string where;
};

std::vector<Doc> read_jsonl(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TaskError(path + ": cannot read");
  std::vector<Doc> docs;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(n);
    auto j = nlohmann::ordered_json::parse(line, nullptr, false);
    if (j.is_discarded()) throw TaskError(where + ": not valid JSON");
    if (!j.is_object()) throw TaskError(where + ": not a JSON object");
    Doc d;
    d.value = Value::from_json(j);
    d.key = nlohmann::json(j).dump();
    d.json = std::move(j);
    d.where = where;
    docs.push_back(std::move(d));
  }
  if (docs.empty()) throw TaskError(path + ": no documents");
  return docs;
}

const std::set<std::string> kJinjaWords = {
    "and", "or", "not", "in", "is", "if", "else", "elif", "endif", "for", "endfor", "set", "endset", "true",
    "false", "none", "True", "False", "None", "loop", "range", "dict", "namespace", "macro", "endmacro", "call",
    "endcall", "filter", "endfilter", "raw", "endraw", "recursive", "with", "endwith", "lipsum", "cycler", "joiner",
    "caller", "varargs", "kwargs", "self"};

// A prompt field: a document field named as it is, a Jinja template over the
// fields, a number, or (doc_to_choice) a fixed list.
struct Field {
  std::string key;  // doc_to_text, ...
  bool given = false;
  std::optional<int64_t> number;
  std::optional<std::vector<std::string>> list;
  std::string text;  // the field name or template source
  std::shared_ptr<jinja::Template> tpl;
  std::vector<std::string> names;  // the document fields the template reads
};

std::vector<std::string> referenced_names(const std::vector<jinja::Token>& toks) {
  using K = jinja::Token::K;
  std::set<std::string> bound, used;
  bool in_tag = false;
  for (size_t i = 0; i < toks.size(); ++i) {
    const auto& t = toks[i];
    if (t.kind == K::var_begin || t.kind == K::block_begin) in_tag = true;
    if (t.kind == K::var_end || t.kind == K::block_end) in_tag = false;
    if (!in_tag || t.kind != K::name || kJinjaWords.count(t.value)) {
      if (in_tag && t.kind == K::name && (t.value == "for" || t.value == "set")) {
        for (size_t j = i + 1; j < toks.size() && toks[j].kind != K::block_end; ++j) {
          if (toks[j].kind == K::name && toks[j].value == "in") break;
          if (toks[j].kind == K::op && toks[j].value == "=") break;
          if (toks[j].kind == K::name) bound.insert(toks[j].value);
        }
      }
      continue;
    }
    const bool attr = i > 0 && toks[i - 1].kind == K::op && (toks[i - 1].value == "." || toks[i - 1].value == "|");
    const bool test = i > 0 && toks[i - 1].kind == K::name && (toks[i - 1].value == "is" || toks[i - 1].value == "not");
    const bool kwarg = i + 1 < toks.size() && toks[i + 1].kind == K::op && toks[i + 1].value == "=";
    if (!attr && !test && !kwarg) used.insert(t.value);
  }
  std::vector<std::string> out;
  for (const auto& n : used)
    if (!bound.count(n)) out.push_back(n);
  return out;
}

Field read_field(const YAML::Node& top, const std::string& key, const std::string& file) {
  Field f;
  f.key = key;
  const auto n = top[key];
  if (!n || n.IsNull()) return f;
  f.given = true;
  if (n.IsSequence()) {
    f.list.emplace();
    for (const auto& e : n) f.list->push_back(e.as<std::string>());
    return f;
  }
  if (n.IsMap()) {  // the harness takes a dict's values
    f.list.emplace();
    for (const auto& e : n) f.list->push_back(e.second.as<std::string>());
    return f;
  }
  f.text = n.as<std::string>();
  if (n.Tag() != "!" && !f.text.empty() && f.text.find_first_not_of("0123456789") == std::string::npos) {
    f.number = std::stoll(f.text);
    return f;
  }
  try {
    // lm-eval's environment: keep_trailing_newline=True, no trim_blocks/lstrip_blocks.
    std::string src = f.text;
    if (!src.empty() && src.back() == '\n') src += '\n';
    const auto toks = jinja::lex(src, jinja::LexOptions{false, false});
    f.names = referenced_names(toks);
    f.tpl = std::make_shared<jinja::Template>(jinja::parse(toks));
  } catch (const jinja::Error& e) {
    throw TaskError(file + ": " + key + ": not a template: " + e.what());
  }
  return f;
}

// Python's ast.literal_eval of a list of strings (what `{{choices}}` renders).
std::vector<std::string> parse_py_list(const std::string& s, const std::string& where) {
  std::vector<std::string> out;
  size_t i = 0;
  auto ws = [&] {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  };
  auto bad = [&]() -> TaskError { return TaskError(where + ": doc_to_choice rendered '" + s + "', not a list of strings"); };
  ws();
  if (i >= s.size() || s[i] != '[') throw bad();
  ++i;
  ws();
  if (i < s.size() && s[i] == ']') return out;
  while (true) {
    ws();
    if (i >= s.size() || (s[i] != '\'' && s[i] != '"')) throw bad();
    const char q = s[i++];
    std::string v;
    while (i < s.size() && s[i] != q) {
      if (s[i] == '\\' && i + 1 < s.size()) {
        const char c = s[++i];
        switch (c) {
          case 'n': v += '\n'; break;
          case 't': v += '\t'; break;
          case 'r': v += '\r'; break;
          case '0': v += '\0'; break;
          case 'x':
          case 'u':
          case 'U': {
            const int len = c == 'x' ? 2 : c == 'u' ? 4 : 8;
            if (i + len >= s.size()) throw bad();
            const uint32_t cp = static_cast<uint32_t>(std::stoul(s.substr(i + 1, len), nullptr, 16));
            jinja::utf8_append(v, cp);
            i += len;
            break;
          }
          default: v += c;
        }
        ++i;
      } else {
        v += s[i++];
      }
    }
    if (i >= s.size()) throw bad();
    ++i;
    out.push_back(std::move(v));
    ws();
    if (i < s.size() && s[i] == ',') {
      ++i;
      ws();
      if (i < s.size() && s[i] == ']') break;
      continue;
    }
    if (i < s.size() && s[i] == ']') break;
    throw bad();
  }
  return out;
}

class Builder {
 public:
  Builder(const std::string& file, const std::set<std::string>& features) : file_(file), features_(features) {}

  // The field's value for `d`: what the harness's doc_to_* returns (a string,
  // an int, or a list), with a missing field named.
  Value eval(const Field& f, const Doc& d, bool has_choices) const {
    if (f.number) return Value(*f.number);
    if (f.list) {
      jinja::List l;
      for (const auto& s : *f.list) l.push_back(Value(s));
      return Value(std::move(l));
    }
    if (features_.count(f.text)) {
      const Value* v = d.value.map().find(f.text);
      if (!v) throw TaskError(d.where + ": the field '" + f.text + "' (" + f.key + ") is missing");
      return *v;
    }
    for (const auto& n : f.names)
      if (!d.value.map().find(n)) throw TaskError(d.where + ": the field '" + n + "' (used by " + f.key + ") is missing");
    std::string s;
    try {
      s = jinja::render(*f.tpl, d.value).text;
    } catch (const jinja::Error& e) {
      throw TaskError(d.where + ": " + f.key + ": " + e.what());
    }
    if (has_choices && !s.empty() && s.find_first_not_of("0123456789") == std::string::npos) return Value(int64_t(std::stoll(s)));
    return Value(s);
  }

  std::string text(const Field& f, const Doc& d) const {
    const Value v = eval(f, d, false);
    if (!v.is_string()) throw TaskError(d.where + ": " + f.key + " gives " + v.type_name() + ", not text");
    return v.str();
  }

  std::vector<std::string> choices(const Field& f, const Doc& d) const {
    Value v;
    if (f.tpl && !features_.count(f.text)) {
      return parse_py_list(eval(f, d, false).str(), d.where);
    }
    v = eval(f, d, false);
    if (!v.is_list()) throw TaskError(d.where + ": doc_to_choice gives " + v.type_name() + ", not a list");
    std::vector<std::string> out;
    for (const auto& e : v.list()) {
      if (!e.is_string()) throw TaskError(d.where + ": doc_to_choice holds " + e.type_name() + ", not text");
      out.push_back(e.str());
    }
    return out;
  }

 private:
  std::string file_;
  const std::set<std::string>& features_;
};

int64_t count_words(const std::string& s) {
  // len(re.split(r"\s+", s)): one more piece than runs of whitespace.
  int64_t runs = 0;
  bool in_ws = false;
  for (size_t i = 0; i < s.size();) {
    const auto [cp, len] = jinja::utf8_decode(s, i);
    const bool w = jinja::is_py_space(cp);
    if (w && !in_ws) ++runs;
    in_ws = w;
    i += std::max<size_t>(1, len);
  }
  return runs + 1;
}

std::string resolve_data_file(const std::string& p, const std::string& yaml_path) {
  if (fs::path(p).is_absolute() || fs::exists(p)) return p;
  const auto beside = fs::path(yaml_path).parent_path() / p;
  return fs::exists(beside) ? beside.string() : p;
}

const std::set<std::string> kTopKeys = {
    "task", "tag", "dataset_path", "dataset_name", "dataset_kwargs", "test_split", "validation_split",
    "training_split", "fewshot_split", "output_type", "doc_to_text", "doc_to_target", "doc_to_choice",
    "target_delimiter", "fewshot_delimiter", "description", "num_fewshot", "fewshot_config", "generation_kwargs",
    "filter_list", "metric_list", "metadata", "repeats", "should_decontaminate"};

}  // namespace

Task load_task(const std::string& yaml_path, int64_t limit) {
  YAML::Node top;
  try {
    top = YAML::LoadFile(yaml_path);
  } catch (const YAML::BadFile&) {
    throw TaskError(yaml_path + ": cannot read");
  } catch (const YAML::Exception& e) {
    throw TaskError(yaml_path + ":" + std::to_string(e.mark.line + 1) + ": not YAML: " + e.msg);
  }
  if (!top.IsMap()) throw TaskError(yaml_path + ": not a task description (a YAML mapping)");
  auto line_of = [&](const std::string& key) { return yaml_path + ":" + std::to_string(top[key].Mark().line + 1); };
  for (const auto& kv : top) {
    const auto k = kv.first.as<std::string>();
    if (!kTopKeys.count(k))
      throw TaskError(yaml_path + ":" + std::to_string(kv.first.Mark().line + 1) + ": unknown or unsupported key '" + k + "'");
  }
  auto str = [&](const std::string& key, const std::string& def) {
    return top[key] && !top[key].IsNull() ? top[key].as<std::string>() : def;
  };
  Task t;
  t.file = yaml_path;
  t.name = str("task", fs::path(yaml_path).stem().string());
  const std::string kind = str("output_type", "");
  if (kind == "multiple_choice") t.kind = Kind::multiple_choice;
  else if (kind == "loglikelihood_rolling") t.kind = Kind::loglikelihood_rolling;
  else if (kind == "generate_until") t.kind = Kind::generate_until;
  else
    throw TaskError((top["output_type"] ? line_of("output_type") : yaml_path) + ": output_type '" + kind +
                    "': expected multiple_choice, loglikelihood_rolling or generate_until");
  if (top["dataset_path"] && str("dataset_path", "") != "json")
    throw TaskError(line_of("dataset_path") + ": dataset_path must be json (local JSON-lines files)");
  if (top["repeats"] && top["repeats"].as<int64_t>() != 1) throw TaskError(line_of("repeats") + ": only repeats: 1");
  const std::string eval_split = str("test_split", str("validation_split", ""));
  if (eval_split.empty()) throw TaskError(yaml_path + ": name the documents' split (test_split or validation_split)");
  const std::string fewshot_split = str("fewshot_split", "");
  const auto files = top["dataset_kwargs"] ? top["dataset_kwargs"]["data_files"] : YAML::Node();
  if (!files || !files.IsMap()) throw TaskError(yaml_path + ": dataset_kwargs.data_files must map splits to JSON-lines files");
  auto split_file = [&](const std::string& split) {
    const auto n = files[split];
    if (!n) throw TaskError(yaml_path + ": dataset_kwargs.data_files has no '" + split + "' split");
    return resolve_data_file(n.IsSequence() ? n[0].as<std::string>() : n.as<std::string>(), yaml_path);
  };
  auto docs = read_jsonl(split_file(eval_split));

  t.num_fewshot = top["num_fewshot"] ? top["num_fewshot"].as<int64_t>() : 0;
  if (t.num_fewshot < 0) throw TaskError(line_of("num_fewshot") + ": num_fewshot must be >= 0");
  std::string sampler = "default";
  if (top["fewshot_config"]) {
    for (const auto& kv : top["fewshot_config"]) {
      const auto k = kv.first.as<std::string>();
      if (k != "sampler") throw TaskError(line_of("fewshot_config") + ": fewshot_config." + k + " is not supported");
    }
    sampler = top["fewshot_config"]["sampler"].as<std::string>("default");
    if (sampler != "default" && sampler != "first_n")
      throw TaskError(line_of("fewshot_config") + ": fewshot_config.sampler '" + sampler + "': expected default or first_n");
  }
  if (top["metadata"] && top["metadata"]["fewshot_seed"]) t.fewshot_seed = top["metadata"]["fewshot_seed"].as<uint64_t>();
  std::vector<Doc> fewshot;
  const bool same_split = fewshot_split == eval_split;
  if (t.num_fewshot > 0) {
    if (fewshot_split.empty()) throw TaskError(yaml_path + ": num_fewshot > 0 needs fewshot_split");
    fewshot = same_split ? docs : read_jsonl(split_file(fewshot_split));
    if (int64_t(fewshot.size()) < t.num_fewshot + (same_split ? 1 : 0))
      throw TaskError(yaml_path + ": num_fewshot " + std::to_string(t.num_fewshot) + " but the few-shot split holds " +
                      std::to_string(fewshot.size()) + " documents");
  }

  std::set<std::string> features;
  for (const auto& d : docs)
    for (auto it = d.json.begin(); it != d.json.end(); ++it) features.insert(it.key());
  const Field text = read_field(top, "doc_to_text", yaml_path), target = read_field(top, "doc_to_target", yaml_path),
              choice = read_field(top, "doc_to_choice", yaml_path), description = read_field(top, "description", yaml_path);
  if (t.kind != Kind::loglikelihood_rolling && !text.given) throw TaskError(yaml_path + ": doc_to_text is required");
  if (!target.given) throw TaskError(yaml_path + ": doc_to_target is required");
  if (t.kind == Kind::multiple_choice && !choice.given) throw TaskError(yaml_path + ": multiple_choice needs doc_to_choice");
  if (text.number) throw TaskError(line_of("doc_to_text") + ": multiple inputs (an index as doc_to_text) are not supported");
  const std::string tgt_delim = str("target_delimiter", " "), few_delim = str("fewshot_delimiter", "\n\n");
  const bool has_choices = choice.given;
  Builder b(yaml_path, features);

  // Metrics: the harness's defaults per kind, or metric_list.
  const std::map<Kind, std::vector<std::string>> allowed = {
      {Kind::multiple_choice, {"acc", "acc_norm", "acc_bytes"}},
      {Kind::loglikelihood_rolling, {"word_perplexity", "byte_perplexity", "bits_per_byte"}},
      {Kind::generate_until, {"exact_match"}}};
  if (top["metric_list"]) {
    for (const auto& m : top["metric_list"]) {
      const auto name = m["metric"].as<std::string>("");
      const auto& ok = allowed.at(t.kind);
      if (std::find(ok.begin(), ok.end(), name) == ok.end())
        throw TaskError(line_of("metric_list") + ": metric '" + name + "' is not one of " + kind + "'s");
      t.metrics.push_back(name);
      for (const auto& kv : m) {
        const auto k = kv.first.as<std::string>();
        if (k == "metric" || k == "aggregation" || k == "higher_is_better") continue;
        if (name != "exact_match") throw TaskError(line_of("metric_list") + ": " + name + " takes no option '" + k + "'");
        if (k == "ignore_case") t.exact.ignore_case = kv.second.as<bool>();
        else if (k == "ignore_punctuation") t.exact.ignore_punctuation = kv.second.as<bool>();
        else if (k == "ignore_numbers") t.exact.ignore_numbers = kv.second.as<bool>();
        else if (k == "regexes_to_ignore") t.exact.regexes_to_ignore = kv.second.as<std::vector<std::string>>();
        else throw TaskError(line_of("metric_list") + ": exact_match takes no option '" + k + "'");
      }
    }
  } else if (t.kind == Kind::multiple_choice) {
    t.metrics = {"acc", "acc_norm"};
  } else {
    t.metrics = allowed.at(t.kind);
  }
  if (t.kind == Kind::generate_until) {
    const auto g = top["generation_kwargs"];
    if (g) {
      for (const auto& kv : g) {
        const auto k = kv.first.as<std::string>();
        if (k == "until") {
          if (kv.second.IsSequence()) t.until = kv.second.as<std::vector<std::string>>();
          else t.until = {kv.second.as<std::string>()};
        } else if (k == "max_gen_toks") {
          t.max_gen_toks = kv.second.as<int64_t>();
        } else if (k == "do_sample") {
          if (kv.second.as<bool>()) throw TaskError(line_of("generation_kwargs") + ": do_sample: true (nnstrain decodes greedily)");
        } else if (k == "temperature") {
          if (kv.second.as<double>() != 0) throw TaskError(line_of("generation_kwargs") + ": temperature must be 0 (greedy)");
        } else {
          throw TaskError(line_of("generation_kwargs") + ": generation_kwargs." + k + " is not supported");
        }
      }
    }
    if (t.max_gen_toks < 1) throw TaskError(line_of("generation_kwargs") + ": max_gen_toks must be >= 1");
    if (top["filter_list"]) {
      const auto fl = top["filter_list"];
      if (!fl.IsSequence() || fl.size() != 1) throw TaskError(line_of("filter_list") + ": one filter pipeline is supported");
      for (const auto& f : fl[0]["filter"]) {
        const auto fn = f["function"].as<std::string>("");
        if (fn == "take_first") continue;
        if (fn != "regex") throw TaskError(line_of("filter_list") + ": filter function '" + fn + "' is not supported (regex, take_first)");
        RegexFilter r;
        r.pattern = f["regex_pattern"].as<std::string>(R"(#### (\-?[0-9\.\,]+))");
        r.group_select = f["group_select"].as<int64_t>(0);
        r.fallback = f["fallback"].as<std::string>("[invalid]");
        try {
          std::regex test(r.pattern);
        } catch (const std::regex_error& e) {
          throw TaskError(line_of("filter_list") + ": regex_pattern '" + r.pattern + "': " + e.what());
        }
        t.regex = r;
      }
    }
  }

  if (limit > 0 && int64_t(docs.size()) > limit) docs.resize(limit);
  PyRandom rnd(t.fewshot_seed);
  for (const auto& d : docs) {
    DocRequests r;
    r.where = d.where;
    if (t.kind == Kind::loglikelihood_rolling) {
      r.text = b.text(target, d);
      r.words = count_words(r.text);
      r.bytes = static_cast<int64_t>(r.text.size());
      t.docs.push_back(std::move(r));
      continue;
    }
    std::string ctx = description.given ? b.text(description, d) : "";
    if (t.num_fewshot > 0) {
      std::vector<const Doc*> shots;
      const auto n = static_cast<size_t>(t.num_fewshot);
      if (sampler == "first_n") {
        for (const auto& f : fewshot)
          if (shots.size() < n && !(same_split && f.key == d.key)) shots.push_back(&f);
      } else if (!same_split) {
        for (auto i : rnd.sample(fewshot.size(), n)) shots.push_back(&fewshot[i]);
      } else {
        for (auto i : rnd.sample(fewshot.size(), n + 1))
          if (fewshot[i].key != d.key && shots.size() < n) shots.push_back(&fewshot[i]);
        if (shots.size() < n) {  // copies of this document drawn: again from the pool without them
          std::vector<const Doc*> pool;
          for (const auto& f : fewshot)
            if (f.key != d.key) pool.push_back(&f);
          shots.clear();
          for (auto i : rnd.sample(pool.size(), n)) shots.push_back(pool[i]);
        }
      }
      for (const Doc* s : shots) {
        const std::string q = b.text(text, *s);
        const Value a = b.eval(target, *s, has_choices);
        std::string answer;
        if (a.is_int() && has_choices) {
          const auto c = b.choices(choice, *s);
          if (a.as_int() < 0 || a.as_int() >= int64_t(c.size()))
            throw TaskError(s->where + ": the gold index " + std::to_string(a.as_int()) + " is outside the " +
                            std::to_string(c.size()) + " choices");
          answer = c[a.as_int()];
        } else if (a.is_list() && !a.list().empty()) {
          answer = a.list()[0].to_str();
        } else {
          answer = a.to_str();
        }
        ctx += answer.empty() ? q : q + tgt_delim + answer + few_delim;
      }
    }
    ctx += b.text(text, d);
    r.context = ctx;
    const Value gold = b.eval(target, d, has_choices);
    if (t.kind == Kind::multiple_choice) {
      r.choices = b.choices(choice, d);
      if (r.choices.empty()) throw TaskError(d.where + ": no choices");
      for (const auto& c : r.choices) r.continuations.push_back(tgt_delim + c);
      if (gold.is_int() && !gold.is_bool()) {
        r.gold = gold.as_int();
      } else if (gold.is_string()) {
        const auto it = std::find(r.choices.begin(), r.choices.end(), gold.str());
        if (it == r.choices.end()) throw TaskError(d.where + ": the gold answer '" + gold.str() + "' is not among the choices");
        r.gold = it - r.choices.begin();
      } else {
        throw TaskError(d.where + ": doc_to_target gives " + gold.type_name() + ", not an index or a choice");
      }
      if (r.gold < 0 || r.gold >= int64_t(r.choices.size()))
        throw TaskError(d.where + ": the gold index " + std::to_string(r.gold) + " is outside the " +
                        std::to_string(r.choices.size()) + " choices");
    } else {
      if (has_choices && gold.is_int()) {
        const auto c = b.choices(choice, d);
        if (gold.as_int() < 0 || gold.as_int() >= int64_t(c.size()))
          throw TaskError(d.where + ": the gold index " + std::to_string(gold.as_int()) + " is outside the choices");
        r.target = c[gold.as_int()];
      } else {
        r.target = gold.to_str();
      }
    }
    t.docs.push_back(std::move(r));
  }
  return t;
}

std::string apply_filter(const Task& t, const std::string& generated) {
  if (!t.regex) return generated;
  const std::regex re(t.regex->pattern);
  // re.findall: the whole match without groups, the group with one, a tuple with more.
  std::vector<std::string> matches;
  std::vector<std::vector<std::string>> groups;
  for (auto it = std::sregex_iterator(generated.begin(), generated.end(), re); it != std::sregex_iterator(); ++it) {
    const auto& m = *it;
    std::vector<std::string> g;
    for (size_t i = 1; i < m.size(); ++i) g.push_back(m[i].str());
    matches.push_back(m.size() == 1 ? m[0].str() : m.size() == 2 ? m[1].str() : "");
    groups.push_back(std::move(g));
  }
  if (matches.empty()) return t.regex->fallback;
  int64_t k = t.regex->group_select;
  if (k < 0) k += int64_t(matches.size());
  if (k < 0 || k >= int64_t(matches.size())) return t.regex->fallback;  // Python would raise IndexError
  std::string m = matches[k];
  if (groups[k].size() > 1) {
    m = t.regex->fallback;
    for (const auto& g : groups[k])
      if (!g.empty()) {
        m = g;
        break;
      }
  }
  const auto b = m.find_first_not_of(" \t\n\r\f\v");
  if (b == std::string::npos) return "";
  return m.substr(b, m.find_last_not_of(" \t\n\r\f\v") - b + 1);
}

bool exact_match(const Task& t, const std::string& prediction, const std::string& reference) {
  std::string p = prediction, r = reference;
  for (const auto& s : t.exact.regexes_to_ignore) {
    const std::regex re(s);
    p = std::regex_replace(p, re, "");
    r = std::regex_replace(r, re, "");
  }
  auto drop = [](std::string& s, const char* set) {
    s.erase(std::remove_if(s.begin(), s.end(), [&](char c) { return std::strchr(set, c) != nullptr && c != 0; }), s.end());
  };
  if (t.exact.ignore_case)
    for (auto& c : p) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t.exact.ignore_case)
    for (auto& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t.exact.ignore_punctuation) drop(p, "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"), drop(r, "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~");
  if (t.exact.ignore_numbers) drop(p, "0123456789"), drop(r, "0123456789");
  return p == r;
}

}  // namespace nnstrain::eval
