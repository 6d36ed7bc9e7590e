"""Chat templates as Hugging Face renders them (issue 52): nnstrain's Jinja engine
against transformers' apply_chat_template (jinja2) on real models' templates.

The corpus: the chat templates llama-cpp-python's source distribution vendors
(vendor/llama.cpp/models/templates/*.jinja; scripts/setup.sh downloads the
sdist, read here from the archive, never copied into the repository). Each is
rendered for the conversations below (system or not, multi-turn, tool
definitions, tool calls with arguments, tool results, thinking, non-ASCII and
special-token-like text, empty content), with add_generation_prompt both ways,
by transformers and by nnstrain in one process call (`nnstrain prepare
chat-render`): the text must be identical to apply_chat_template(tokenize=False),
the ids to apply_chat_template(tokenize=True) (special-token text in content as
tokens) and to tokenize=True with sanitize_control_tokens=True (as text, nnstrain's
default), and a conversation transformers refuses must be refused here.

Masks: on templates with {% generation %} blocks, the targets equal transformers'
return_assistant_tokens_mask; on three without, the target tokens decode to what
each assistant turn adds (its content and end-of-turn token), written out here."""
import json
import pathlib
import re
import subprocess
import tarfile

import pytest

from chat_common import SPECIALS, _train
from conftest import SOURCE, nnstrain_bin_path

transformers = pytest.importorskip("transformers")

SDIST = pathlib.Path.home() / ".cache/nnstrain/sdist/llama_cpp_python-0.3.36.tar.gz"

# Templates of the corpus nnstrain does not render as transformers does, and why.
KNOWN_DIFFERENCES = {}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": {"city": "Paris", "unit": "celsius"}}}
CALL_STR = {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": "{\"city\": \"Tōkyō\"}"}}

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."}]},
    {"messages": [{"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Tell me a joke about cats."},
                  {"role": "assistant", "content": "  Cats\tdo not tell jokes.\n"},
                  {"role": "user", "content": "Another one"},
                  {"role": "assistant", "content": "No."}]},
    {"messages": [{"role": "user", "content": "Just a question, no answer yet"}]},
    {"messages": [{"role": "system", "content": "You can call tools."},
                  {"role": "user", "content": "What's the weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                   "content": "{\"temperature\": 22.5, \"sky\": \"sunny\"}"},
                  {"role": "assistant", "content": "It is 22.5 °C and sunny in Paris."}],
     "tools": TOOLS},
    {"messages": [{"role": "user", "content": "Ünïcödé ☃ 日本語 テキスト 🙂👍 — and Zürich?"},
                  {"role": "assistant", "content": "Grüße aus 東京 🙂"}]},
    {"messages": [{"role": "system", "content": "Say <|im_end|> and </s> as text."},
                  {"role": "user", "content": "Print <|im_start|> or <s> [INST] please <|eot_id|>"},
                  {"role": "assistant", "content": "Here: <|eot_id|> <|im_end|> </s> <end_of_turn> done"}]},
    {"messages": [{"role": "user", "content": ""},
                  {"role": "assistant", "content": ""},
                  {"role": "user", "content": "Now say something"},
                  {"role": "assistant", "content": "Something."}]},
    {"messages": [{"role": "user", "content": "Think first: 2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
                  {"role": "user", "content": "And 3+3?"},
                  {"role": "assistant", "content": "6", "reasoning_content": "Three and three make six."}]},
    {"messages": [{"role": "user", "content": "Weather in Tokyo, please."},
                  {"role": "assistant", "content": None, "tool_calls": [CALL_STR]},
                  {"role": "tool", "tool_call_id": "call_2", "content": "rainy"}],
     "tools": TOOLS},
    {"messages": [{"role": "system", "content": "Be kind."},
                  {"role": "user", "content": "First"},
                  {"role": "assistant", "content": "One"},
                  {"role": "user", "content": "Second"}],
     "kwargs": {"enable_thinking": False}},
]

# Templates with {% generation %} blocks (the corpus has none): written here.
GENERATION_TEMPLATES = {
    "chatml_generation": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llama3_generation": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{%- if message['role'] == 'assistant' -%}{% generation %}{{ message['content'] | trim }}<|eot_id|>"
        "{% endgeneration %}{%- else -%}{{ message['content'] | trim }}<|eot_id|>{%- endif -%}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "thinking_generation": (
        "{%- for m in messages -%}\n"
        "  {%- if m.role == 'assistant' -%}\n"
        "    <|im_start|>assistant\n"
        "    {%- generation -%}\n"
        "      {%- if m.reasoning_content is defined and loop.last %}<think>{{ m.reasoning_content }}</think>{% endif -%}\n"
        "      {{ m.content }}<|im_end|>\n"
        "    {%- endgeneration %}\n"
        "\n"
        "  {%- else -%}\n"
        "    <|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "\n"
        "  {%- endif -%}\n"
        "{%- endfor -%}"),
}


def corpus():
    """{name: template text} from the sdist's vendored llama.cpp templates."""
    if not SDIST.exists():
        pytest.skip(f"{SDIST} is missing: scripts/setup.sh (test setup) downloads it")
    out = {}
    with tarfile.open(SDIST) as tar:
        for m in tar:
            if re.search(r"/vendor/llama\.cpp/models/templates/[^/]+\.jinja$", m.name):
                out[pathlib.Path(m.name).stem] = tar.extractfile(m).read().decode("utf-8")
    assert len(out) >= 60, f"{len(out)} templates in {SDIST}"
    return dict(sorted(out.items()))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The corpus, and a tokenizer folder: chat_common's BPE with the corpus's special tokens added
    (<|...|> and <...> names the templates write), <think> and </think> as non-special added tokens."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer
    templates = corpus()
    found = set(SPECIALS)
    for text in list(templates.values()) + list(GENERATION_TEMPLATES.values()):
        found |= set(re.findall(r"<\|[A-Za-z0-9_]+\|>|<｜[^｜<>]{1,40}｜>|<(?:start|end)_of_turn>|<bos>|<eos>", text))
    folder = tmp_path_factory.mktemp("tok")
    t = _train()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in sorted(found)])
    t.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>", "<tool_call>")])
    (folder / "tokenizer.json").write_text(t.to_str(), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}))
    return templates, folder, AutoTokenizer.from_pretrained(str(folder))


def run_batch(tmp_path, folder, templates, conversations, content_specials, prompts=(False, True), name="batch"):
    """nnstrain prepare chat-render over every template x conversation x prompt: {(t, c, p): line}."""
    batch = {"tokenizer": str(folder), "templates": [{"text": text, "source": n} for n, text in templates.items()],
             "conversations": conversations, "add_generation_prompt": list(prompts),
             "content_specials": content_specials}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(batch, ensure_ascii=False), encoding="utf-8")
    p = subprocess.run([nnstrain_bin_path(), "prepare", "chat-render", str(path)], cwd=SOURCE,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    names = list(templates)
    out, compile_errors = {}, {}
    for line in p.stdout.splitlines():
        j = json.loads(line)
        if "seconds" in j:
            continue
        if "conversation" not in j:
            compile_errors[names[j["template"]]] = j["error"]
            continue
        out[(names[j["template"]], j["conversation"], j["add_generation_prompt"])] = j
    return out, compile_errors


def hf_render(tok, text, conv, agp, **kw):
    try:
        return tok.apply_chat_template(conv["messages"], tools=conv.get("tools"), chat_template=text,
                                       add_generation_prompt=agp, **conv.get("kwargs", {}), **kw), None
    except Exception as e:  # noqa: BLE001 - any refusal counts
        return None, f"{type(e).__name__}: {e}"


def test_corpus_renders_as_transformers(tmp_path, setup):
    templates, folder, tok = setup
    ours, compile_errors = run_batch(tmp_path, folder, templates, CONVERSATIONS, "special")
    ours_text, _ = run_batch(tmp_path, folder, templates, CONVERSATIONS, "text", name="sanitized")
    report, mask_errors, counts = {}, {}, {"renderings": 0, "text": 0, "ids": 0, "sanitized_ids": 0, "refused": 0}
    for name, text in templates.items():
        problems = []
        for ci, conv in enumerate(CONVERSATIONS):
            for agp in (False, True):
                want, err = hf_render(tok, text, conv, agp, tokenize=False)
                counts["renderings"] += 1
                ours_line = ours.get((name, ci, agp), {"error": compile_errors.get(name, "no output")})
                if err is not None:
                    if "error" in ours_line:
                        counts["refused"] += 1
                    else:
                        problems.append(f"conversation {ci} prompt {agp}: transformers refuses ({err[:120]}), "
                                        "nnstrain renders")
                    continue
                if "error" in ours_line:
                    problems.append(f"conversation {ci} prompt {agp}: nnstrain refuses: {ours_line['error'][:200]}")
                    continue
                if ours_line["text"] != want:
                    a, b = ours_line["text"], want
                    k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
                    problems.append(f"conversation {ci} prompt {agp}: text differs at {k}: "
                                    f"ours {a[max(0, k - 30):k + 40]!r} transformers {b[max(0, k - 30):k + 40]!r}")
                    continue
                counts["text"] += 1
                if not agp and "target_error" in ours_line:
                    mask_errors.setdefault(name, []).append(f"conversation {ci}: {ours_line['target_error']}")
                ids, _ = hf_render(tok, text, conv, agp, tokenize=True, return_dict=False)
                if ours_line["ids"] == ids:
                    counts["ids"] += 1
                else:
                    problems.append(f"conversation {ci} prompt {agp}: ids differ")
                sanitized, err2 = hf_render(tok, text, conv, agp, tokenize=True, return_dict=False,
                                            sanitize_control_tokens=True)
                ours_s = ours_text.get((name, ci, agp), {})
                if err2 is None and ours_s.get("ids") == sanitized:
                    counts["sanitized_ids"] += 1
                elif err2 is None:
                    problems.append(f"conversation {ci} prompt {agp}: ids with special-token text as text differ")
        if problems:
            report[name] = problems
    print(f"\n{len(templates)} templates, {len(CONVERSATIONS)} conversations x add_generation_prompt both ways: "
          f"{counts}")
    for name, problems in report.items():
        print(f"  {name}: {len(problems)} differ; {problems[0]}")
    for name, errors in mask_errors.items():
        print(f"  {name}: no loss mask for {len(errors)} conversations; {errors[0][:200]}")
    unexpected = {n: p for n, p in report.items() if n not in KNOWN_DIFFERENCES}
    assert not unexpected, "\n".join(f"{n}: {p[:3]}" for n, p in unexpected.items())
    stale = [n for n in KNOWN_DIFFERENCES if n not in report]
    assert not stale, f"listed as differing but rendered alike: {stale}"
    assert counts["text"] >= 0.8 * counts["renderings"] - counts["refused"], counts


def test_generation_block_masks_equal_transformers(tmp_path, setup):
    _, folder, tok = setup
    convs = [c for c in CONVERSATIONS if any(m["role"] == "assistant" for m in c["messages"])]
    ours, errors = run_batch(tmp_path, folder, GENERATION_TEMPLATES, convs, "special", prompts=(False,))
    assert not errors, errors
    checked = 0
    for name, text in GENERATION_TEMPLATES.items():
        for ci, conv in enumerate(convs):
            line = ours[(name, ci, False)]
            try:
                out = tok.apply_chat_template(conv["messages"], chat_template=text, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            except Exception:  # noqa: BLE001 - refused there, refused here
                assert "error" in line, f"{name} conversation {ci}: transformers refuses, nnstrain renders"
                continue
            assert line["ids"] == out["input_ids"], f"{name} conversation {ci}: ids"
            assert line["target"] == out["assistant_masks"], \
                f"{name} conversation {ci}\nours {line['target']}\nhf   {out['assistant_masks']}"
            assert any(line["target"]), f"{name} conversation {ci}: no target"
            checked += 1
    assert checked >= 2 * len(convs), checked


def runs(ids, target, tok):
    """The target tokens' contiguous runs, decoded."""
    out, cur = [], []
    for i, t in zip(ids, target):
        if t:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    if cur:
        out.append(tok.decode(cur, skip_special_tokens=False))
    return out


# Three templates without generation blocks: what each assistant turn trains on, by hand.
PREFIX_TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": lambda content: content + "<|im_end|>",
    "meta-llama-Llama-3.1-8B-Instruct": lambda content: content.strip() + "<|eot_id|>",
    "google-gemma-2-2b-it": lambda content: content.strip() + "<end_of_turn>",
}


def test_prefix_masks_by_hand(tmp_path, setup):
    templates, folder, tok = setup
    convs = [CONVERSATIONS[1], CONVERSATIONS[4], CONVERSATIONS[6]]  # gemma-2 refuses a system turn
    chosen = {n: templates[n] for n in PREFIX_TEMPLATES}
    for train_on in ("all", "last"):
        batch = {"tokenizer": str(folder), "templates": [{"text": t, "source": n} for n, t in chosen.items()],
                 "conversations": convs, "content_specials": "special", "train_on": train_on}
        path = tmp_path / f"prefix_{train_on}.json"
        path.write_text(json.dumps(batch, ensure_ascii=False), encoding="utf-8")
        p = subprocess.run([nnstrain_bin_path(), "prepare", "chat-render", str(path)], cwd=SOURCE,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        lines = [json.loads(x) for x in p.stdout.splitlines() if "conversation" in x]
        assert len(lines) == len(chosen) * len(convs)
        for line in lines:
            name = list(chosen)[line["template"]]
            conv = convs[line["conversation"]]
            assert "error" not in line, line
            want = [PREFIX_TEMPLATES[name](m["content"]) for m in conv["messages"] if m["role"] == "assistant"]
            if train_on == "last":
                want = want[-1:]
            got = runs(line["ids"], line["target"], tok)
            # An empty answer's end-of-turn token joins no run of its own when nothing precedes it.
            assert got == want, f"{name} conversation {line['conversation']} ({train_on}): {got} != {want}"


# Snippets rendered by transformers' jinja2 environment and by nnstrain over DATA: the text must be
# identical or both must refuse. ADDRESS: jinja2 prints a generator's address ("<generator object
# select_or_reject at 0x7f...>", never the same twice); nnstrain refuses those (docs/chat_templates.md).
DATA = {"xs": [1, 2, 3], "ys": [3, 1, 2, 1], "ds": [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}, {"a": 1, "b": "z"}],
        "d": {"b": 2, "a": 1}, "words": ["Banana", "apple", "cherry"], "s": "Hello big wide World",
        "none": None, "nested": [{"p": {"q": 3}}, {"p": {"q": 1}}], "f": 2.5, "neg": -3}
GENERATORS = [
    "{% for x in xs|map('string') %}{{ x }};{% endfor %}",
    "{{ xs|map('string')|list }}",
    "{{ xs|map('string')|join(',') }}",
    "{{ xs|map('string')|first }}",
    "{{ xs|map('string')|length }}",
    "{{ xs|select('odd')|count }}",
    "{{ xs|map('string')|last }}",
    "{{ xs|map('string')|tojson }}",
    "{{ ds|map(attribute='a')|tojson(indent=2) }}",
    "{{ 'y' if xs|select('odd') else 'n' }}",
    "{{ 'y' if xs|select('gt', 5) else 'n' }}{{ 'y' if none|map('string') else 'n' }}",
    "{{ 1 in xs|select('odd') }}{{ 2 in xs|select('odd') }}",
    "{% set g = xs|select('odd') %}{{ g|list }}{{ g|list }}",
    "{% set g = xs|select('odd') %}{{ 1 in g }}{{ g|list }}",
    "{% set g = xs|select('odd') %}{{ g|first }}{{ g|list }}",
    "{% set g = xs|select('odd') %}{% for a in g %}{{ a }}{% endfor %}{% for a in g %}{{ a }}{% endfor %}",
    "{% for a in xs|select('odd') %}{{ loop.index }}/{{ loop.length }}{{ loop.last }} {% endfor %}",
    "{% for a in xs|select('gt', 9) %}{{ a }}{% else %}empty{% endfor %}",
    "{{ xs|select('odd')|sum }} {{ xs|select('odd')|max }} {{ xs|select('odd')|min }}",
    "{{ xs|select('odd')|sort }} {{ xs|select('odd')|reverse }}",
    "{{ ys|unique|list }} {{ words|map('lower')|unique|list }} {{ ds|unique(attribute='a')|list }}",
    "{{ ds|map(attribute='b')|unique|list }}",
    "{{ [[1], [1]]|unique|list }}",
    "{{ (xs|select('odd'))[0] is defined }}{{ (xs|select('odd')).foo is defined }}",
    "{{ xs|select('odd') is iterable }}{{ xs|select('odd') is sequence }}{{ xs|select('odd') is none }}",
    "{{ xs|select('odd') == [1, 3] }}",
    "{{ (xs|select('odd')) + [1] }}",
    "{{ ds|selectattr('a', 'gt', 1)|list }} {{ ds|rejectattr('a', 'equalto', 1)|map(attribute='b')|list }}",
    "{{ xs|reject('odd')|list }} {{ nested|map(attribute='p.q')|list }} {{ ds|map(attribute='c', default=0)|list }}",
    "{{ none|map('string')|list }}{{ none|select|list }}{{ []|map('upper')|list }}",
    "{{ none|map('string')|tojson }}",
    "{{ xs|map('nosuchfilter')|list }}",
    "{{ []|map('nosuchfilter')|list }}",
    "{{ xs|select('nosuchtest')|list }}",
    "{{ xs|map('nosuchfilter') is defined }}",
    "{{ 5|map('string') is defined }}{{ 5|map('string')|list }}",
    "{% set a, b = xs|select('odd') %}{{ a }}{{ b }}",
    "{{ dict(d|items) }} {{ d|items|list|length }} {% for k, v in d|items|list %}{{ k }}{{ v }}{% endfor %}",
    "{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}{% for k, v in none|items %}{{ k }}{% endfor %}",
    "{% for k, v in s|items %}{{ k }}{% endfor %}",
    "{{ s|items is defined }}",
    "{{ xs|reverse|list }} {{ d|reverse|list }} {{ s|reverse }} {{ xs|select('odd')|reverse|list }}",
    "{{ xs|reverse|tojson }}",
    "{{ xs|reverse|length }}",
    "{{ xs|reverse|first }}{{ xs|reverse|join('-') }}",
    "{{ xs|select('odd')|map('string')|map('upper')|join }}",
    "{% set g = xs|select %}{% set h = xs|select %}{{ g is sameas g }}{{ g is sameas h }}",
    "{{ xs|select('odd')|int }} {{ xs|select('odd')|default('none') is iterable }}",
    "{{ xs|map('string')|map('int')|sum }}",
    "{{ ds|select|selectattr('a', 'eq', 1)|map(attribute='b')|list }}",
    "{% macro m(seq) %}{{ seq|join('+') }}{% endmacro %}{{ m(xs|map('string')) }}",
]
ADDRESS = [
    "{{ xs|select('odd') }}",
    "{{ xs|map('string')|string }}",
    "{{ xs|select('odd') ~ 'a' }}",
    "{{ [xs|select('odd')] }}",
    "{{ xs|reverse }}",
    "{{ d|items }}",
    "{{ xs|unique }}",
]

FILTERS = [
    "{{ xs|batch(2)|list }}{{ xs|batch(2, 0)|list }}{{ xs|batch(linecount=3)|list }}{{ []|batch(2)|list }}",
    "{{ xs|batch(2)|tojson }}",
    "{% for row in ds|batch(2, fill_with={'b': '-'}) %}{{ row|map(attribute='b')|join }};{% endfor %}",
    "{{ xs|slice(2)|list }}{{ ys|slice(3, 'x')|list }}{{ []|slice(2)|list }}{{ xs|select('odd')|slice(1)|list }}",
    "{{ xs|slice(0)|list }}",
    "{{ xs|slice(2) is iterable }}{{ xs|slice(0) is defined }}",
    "{{ s|truncate(9) }}|{{ s|truncate(9, True) }}|{{ s|truncate(length=11, end='!', leeway=0) }}",
    "{{ s|truncate(15) }}|{{ s|truncate(15, leeway=0) }}|{{ 'Ünïcödé ☃ 日本語 テキスト'|truncate(8, leeway=0) }}",
    "{{ s|truncate(killwords=true, length=7, leeway=0, end='') }}|{{ s|truncate(255) }}|{{ nothing|truncate(3) }}",
    "{{ none|truncate(3) }}",
    "{{ s|truncate(2) }}",
    "{{ s|truncate(5, leeway=-1) }}",
    "{{ xs|truncate(3) }}",
    "{{ ds|groupby('b') }}",
    "{{ ds|groupby('c', default='k')|list }}",
    "{{ ds|groupby('c') }}",
    "{% for g in ds|groupby('a') %}{{ g.grouper }}:{{ g.list|map(attribute='b')|join }};{% endfor %}",
    "{% for k, items in words|groupby('0') %}{{ k }}={{ items|join }};{% endfor %}",
    "{% for k, items in nested|groupby('p.q') %}{{ k }}={{ items|length }};{% endfor %}",
    "{% set c = [{'c': 'CA'}, {'c': 'ny'}, {'c': 'ca'}] %}{{ c|groupby('c')|map(attribute='grouper')|list }} "
    "{{ c|groupby(attribute='c', case_sensitive=true)|map(attribute='list')|list }}",
    "{{ ds|groupby('a')|tojson }} {{ ds|groupby('a')|length }} {{ (ds|groupby('a'))[0].grouper }}",
    "{{ nested|map(attribute='x.y')|list }}",
    "{{ (1, 2) }}{{ (1,) }}{{ () }}{{ (1, 2) == [1, 2] }}{{ '%s-%s' % (1, 2) }}{{ '%s' % [1, 2] }}{{ (1, 2)[1:] }}",
    "{{ (1, 2) + [3] }}",
    "{{ [3] + (1, 2) }}",
    "{{ (1, 2) + (3,) }}{{ (1,) * 2 }}{{ d.items()|list }} {{ d|dictsort }} {{ d|dictsort(by='value', reverse=true) }}",
    "{{ (1, 2) < [1, 2] }}",
    "{{ '%s, %s'|format('a', 'b') }}{{ '%s'|format([1, 2]) }}{{ '%d%%'|format(5) }}",
    "{{ 1234567|filesizeformat }} {{ 1|filesizeformat }} {{ 999|filesizeformat }} {{ 1024|filesizeformat(true) }} "
    "{{ '2048'|filesizeformat }} {{ (1000**6)|filesizeformat }} {{ 3.5e30|filesizeformat }}",
    "{{ 'a b/c?d=é'|urlencode }} {{ d|urlencode }} {{ [('k', 'v w')]|urlencode }} {{ 5|urlencode }}",
    "{{ xs|sum }} {{ ds|sum(attribute='a') }} {{ xs|sum(start=10) }} {{ [0.5, 1]|sum }}",
    "{{ ys|min }} {{ ys|max }} {{ words|min }} {{ words|max(case_sensitive=true) }} {{ ds|max(attribute='a') }}",
    "{{ []|max is defined }}",
    "{{ ys|sort }} {{ words|sort }} {{ words|sort(case_sensitive=true) }} {{ ys|sort(reverse=true) }} "
    "{{ ds|sort(attribute='b', reverse=true)|map(attribute='b')|join }} {{ ds|sort(attribute='a,b')|length }}",
    "{{ d|dictsort }} {{ {'B': 1, 'a': 2}|dictsort(true) }} {{ d|dictsort(false, 'value') }}",
    "{{ s|reverse }} {{ ys|reverse|list }}",
    "{{ f|round }} {{ 2.45|round(1) }} {{ 2.675|round(2) }} {{ 0.125|round(2) }} {{ 1234.5|round(-2) }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.1|round(0, 'ceil') }} "
    "{{ 2.9|round(method='floor') }} {{ 7|round }} {{ -2.5|round }}",
    "{{ neg|abs }} {{ -2.5|abs }} {{ '3.5'|float }} {{ 'x'|float }} {{ 'x'|float(1.5) }} {{ 3|float }}",
    "{{ '42'|int }} {{ '4.7'|int }} {{ 'x'|int(7) }} {{ f|int }} {{ ' 12 '|int }} {{ true|int }}",
    "{{ d|attr('b') is defined }} {{ s|attr('upper') is defined }}",
    "{{ 'hello wORLD-foo bar'|title }} {{ s|wordcount }} {{ 'x'|center(9) }}| {{ s|capitalize }} {{ s|upper }}",
    "{{ s|replace('o', '0') }} {{ s|replace('o', '0', 1) }} {{ s|lower }} {{ '  x  '|trim }} {{ 'xxaxx'|trim('x') }}",
    "{{ 'a\nb\n\nc'|indent }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent('> ', blank=true) }}",
    "{{ '<b>&'|escape }} {{ '<b>'|e|safe }} {{ '<b>'|e|forceescape }} {{ xs|join(', ') }} {{ ds|join('/', attribute='b') }}",
    "{{ xs|first }} {{ xs|last }} {{ s|first }} {{ s|length }} {{ d|length }} {{ s|list|length }} {{ d|list }}",
    "{{ none|default('x') }} {{ undefined_name|default('x') }} {{ ''|default('x', true) }} {{ ''|d('y') }}",
    "{{ ds|tojson }} {{ d|tojson(sort_keys=true) }} {{ d|tojson(indent=2) }} {{ s|string }} {{ xs|string }}",
    "{{ xs|random }}",
    "{{ s|wordwrap(5) }}",
    "{{ '<b>x</b>'|striptags }}",
    "{{ d|xmlattr }}",
    "{{ d|pprint }}",
    "{{ s|urlize }}",
    "{% if false %}{{ s|nosuchfilter }}{% endif %}ok",
]
# jinja2 renders these; nnstrain refuses them with "the filter 'NAME' is not supported".
UNSUPPORTED = ["random", "wordwrap", "striptags", "xmlattr", "pprint", "urlize"]


def render_snippets(tmp_path, snippets, name="snippets"):
    """[(jinja2's text or None, its error or None, nnstrain's JSON line)] for each snippet over DATA."""
    from transformers.utils.chat_template_utils import _compile_jinja_template
    from chat_common import write_tokenizer
    folder = write_tokenizer(tmp_path / "tok")
    batch = {"tokenizer": str(folder), "templates": [{"text": t, "source": f"snippet{i}"}
                                                     for i, t in enumerate(snippets)],
             "conversations": [{"messages": [{"role": "user", "content": "hi"}], "kwargs": DATA}]}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(batch), encoding="utf-8")
    p = subprocess.run([nnstrain_bin_path(), "prepare", "chat-render", str(path)], cwd=SOURCE,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    ours = {}
    for line in p.stdout.splitlines():
        j = json.loads(line)
        if "template" in j:
            ours[j["template"]] = j
    out = []
    for i, t in enumerate(snippets):
        try:
            want, err = _compile_jinja_template(t).render(messages=[{"role": "user", "content": "hi"}], **DATA), None
        except Exception as e:  # noqa: BLE001 - any refusal counts
            want, err = None, f"{type(e).__name__}: {e}"
        out.append((want, err, ours[i]))
    return out


def test_generators_as_jinja2(tmp_path):
    """jinja2's map/select/reject/selectattr/rejectattr/unique/items return generators, |reverse an iterator:
    lazy, single use, no len(), refused by tojson; nnstrain's behave alike."""
    results = render_snippets(tmp_path, GENERATORS + ADDRESS)
    refused = 0
    for snippet, (want, err, line) in zip(GENERATORS + ADDRESS, results):
        if snippet in ADDRESS:
            assert err is None and re.search(r"<\w+ object( \w+)? at 0x[0-9a-f]+>", want), (snippet, want, err)
            assert "error" in line and "convert it with |list" in line["error"], (snippet, line)
            assert re.match(r"snippet\d+:1:\d+: ", line["error"]) and "\n" not in line["error"], line["error"]
            continue
        if err is not None:
            assert "error" in line, f"{snippet}: jinja2 refuses ({err}), nnstrain renders {line.get('text')!r}"
            assert re.match(r"snippet\d+:1:\d+: ", line["error"]) and "\n" not in line["error"], line["error"]
            refused += 1
            continue
        assert "error" not in line, f"{snippet}: nnstrain refuses: {line['error']}; jinja2 renders {want!r}"
        assert line["text"] == want, f"{snippet}: ours {line['text']!r} jinja2 {want!r}"
    assert refused >= 8, refused  # len(), reversed(), json.dumps(), unhashable, ... refuse


def test_filters_as_jinja2(tmp_path):
    """jinja2's built-in filters (jinja2.filters.FILTERS): nnstrain renders each as jinja2 does, keyword arguments
    included, refuses where jinja2 refuses, and names the template, line and column of one it lacks."""
    import jinja2.filters
    from transformers.utils.chat_template_utils import _compile_jinja_template
    env_filters = set(_compile_jinja_template("x").environment.filters)
    assert set(jinja2.filters.FILTERS) <= env_filters
    used = {m for sn in FILTERS + GENERATORS for m in re.findall(r"\|\s*(\w+)", sn)}
    missing = set(jinja2.filters.FILTERS) - used
    assert not missing, f"filters without a parity snippet: {sorted(missing)}"
    results = render_snippets(tmp_path, FILTERS)
    refused = 0
    for snippet, (want, err, line) in zip(FILTERS, results):
        lacking = [n for n in UNSUPPORTED if f"|{n}" in snippet.replace(" ", "")]
        if lacking:
            assert err is None, (snippet, err)
            assert re.fullmatch(rf"snippet\d+:1:\d+: the filter '{lacking[0]}' is not supported", line.get("error", "")), \
                (snippet, line)
            continue
        if err is not None:
            assert "error" in line, f"{snippet}: jinja2 refuses ({err}), nnstrain renders {line.get('text')!r}"
            assert re.match(r"snippet\d+:1:\d+: ", line["error"]) and "\n" not in line["error"], line["error"]
            refused += 1
            continue
        assert "error" not in line, f"{snippet}: nnstrain refuses: {line['error']}; jinja2 renders {want!r}"
        assert line["text"] == want, f"{snippet}: ours {line['text']!r} jinja2 {want!r}"
    assert refused >= 8, refused
