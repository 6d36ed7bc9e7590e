"""Chat data (issue 40): `nnstrain prepare corpus --format chat` against transformers.

For each of llama3, chatml (Qwen2's) and mistral, the model's own chat template
string is written into a tokenizer_config.json and transformers'
apply_chat_template renders the conversations (system prompt present or absent,
empty turns, Unicode, special-token strings inside content); the documents
prepare corpus stores must decode to that text, hold the ids transformers gives
the rendered text (where no content holds special-token text; where some does,
the ids of a reference written here that encodes content as text), and mark as
targets exactly the tokens a reference written here marks: those overlapping an
assistant's content and its end-of-turn token. Also: ShareGPT records equal
OpenAI ones, train_on last, over-long conversations truncated or split at a user
turn, and bad input (no assistant turn, a message without a role, a malformed
line, a template whose tokens the tokenizer lacks) handled as --on-error says,
naming file and line. The manifest records the template's source and SHA-256."""
import json
import subprocess

import pytest

from chat_common import CONVERSATIONS, TEMPLATES, TOKENS, ids_and_mask, read_indexed, write_jsonl, write_tokenizer
from conftest import SOURCE, nnstrain_bin_path, single_process_env


def prepare(tmp_path, template, inputs, *extra, name="chat"):
    cmd = [nnstrain_bin_path(), "prepare", "corpus", "--format", "chat", "--chat-template", template,
           "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / name), "--threads", "2", *extra]
    for i in inputs:
        cmd += ["--input", str(i)]
    return subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{template: (transformers tokenizer, tokenizers.Tokenizer encoding special text as text)}, and the folder."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in TEMPLATES:
        folder = write_tokenizer(root / name, name)
        raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
        raw.encode_special_tokens = True  # content's special-token text stays text
        out[name] = (AutoTokenizer.from_pretrained(str(folder)), raw)
    return out, root


def content_spans(rendered, messages, template):
    """Where each message's content lies in the rendered text (found after its template
    prefix, in order): [(role, start, end)]."""
    spans, at = [], 0
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    for i, m in enumerate(messages):
        c = m["content"].strip() if template == "llama3" else m["content"]
        if template == "llama3":
            prefix = f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
        elif template == "chatml":
            prefix = f"<|im_start|>{m['role']}\n"
        elif m["role"] == "system":
            continue  # mistral: inside the first user turn
        elif m["role"] == "user":
            prefix = " [INST] "
        else:
            prefix = " [/INST] "
        start = rendered.index(prefix, at) + len(prefix)
        if template == "mistral" and m["role"] == "user" and system is not None and i == 1:
            spans.append(("system", start, start + len(system)))  # the system turn opens the first user turn
            start += len(system) + 2
        assert rendered.startswith(c, start), (rendered, c, start)
        spans.append((m["role"], start, start + len(c)))
        at = start + len(c)
    return spans


def reference(rendered, messages, template, raw, last_only=False):
    """Ids and target flags as this test states the rule: the text split at the template's
    special tokens (those outside any content), each piece encoded as text; a token is a
    target if it overlaps an assistant's content or is the end-of-turn token closing it."""
    spans = content_spans(rendered, messages, template)
    eot = TOKENS[template][2]
    assistant = [(s, e) for r, s, e in spans if r == "assistant"]
    if last_only:
        assistant = assistant[-1:]
    targets = [(s, e + len(eot)) for s, e in assistant]
    specials = sorted({t for t in (TOKENS[template][0], TOKENS[template][1], "<|start_header_id|>",
                                   "<|end_header_id|>", "<|im_start|>", "<|im_end|>") if t})
    inside = lambda p: any(s <= p < e for _, s, e in spans)
    ids, mask, pos, text_start = [], [], 0, 0

    def flush(end):
        if end > text_start:
            enc = raw.encode(rendered[text_start:end], add_special_tokens=False)
            for tid, (a, b) in zip(enc.ids, enc.offsets):
                ids.append(tid)
                mask.append(any(a + text_start < e and s < b + text_start for s, e in targets))

    while pos < len(rendered):
        hit = next((t for t in specials if rendered.startswith(t, pos) and not inside(pos)), None)
        if hit is None:
            pos += 1
            continue
        flush(pos)
        ids.append(raw.token_to_id(hit))
        mask.append(any(s <= pos < e for s, e in targets))
        pos += len(hit)
        text_start = pos
    flush(len(rendered))
    return ids, mask


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_templates_and_masks_match_transformers(tmp_path, hf, template):
    tokenizers, root = hf
    tok, raw = tokenizers[template]
    # Each conversation with and without its system prompt.
    variants = []
    for c in CONVERSATIONS:
        variants.append(c)
        if c[0]["role"] == "system":
            variants.append(c[1:])
    (tmp_path / "tok").symlink_to(root / template)
    p = prepare(tmp_path, template, [write_jsonl(tmp_path / "c.jsonl", variants)])
    assert p.returncode == 0, p.stderr
    docs = read_indexed(tmp_path / "chat")
    assert len(docs) == len(variants)
    manifest = json.loads((tmp_path / "chat.manifest.json").read_text())
    assert manifest["sequences_per_document"] == "alternating" and manifest["settings"]["chat_template"] == template
    import hashlib
    assert manifest["settings"]["chat_template_sha256"] == hashlib.sha256(TEMPLATES[template].encode()).hexdigest()
    assert manifest["settings"]["chat_template_source"] == f"built-in {template}"
    for k, (conv, doc) in enumerate(zip(variants, docs)):
        rendered = tok.apply_chat_template(conv, tokenize=False)
        ids, mask = ids_and_mask(doc)
        assert raw.decode(ids, skip_special_tokens=False) == rendered, f"{template} conversation {k}: text differs"
        want_ids, want_mask = reference(rendered, conv, template, raw)
        assert ids == want_ids, f"{template} conversation {k}: ids differ from the reference"
        specials_in_content = any(s in m["content"] for m in conv for s in ("<|", "<s>", "</s>"))
        if not specials_in_content:  # transformers' own tokenization of the rendered text
            assert ids == tok.encode(rendered, add_special_tokens=False), f"{template} conversation {k}"
        assert mask == want_mask, f"{template} conversation {k}: target flags differ\nours {mask}\nref  {want_mask}"
        assert any(mask), f"{template} conversation {k}: no target"


def test_sharegpt_equals_openai_and_train_on_last(tmp_path, hf):
    tokenizers, root = hf
    (tmp_path / "tok").symlink_to(root / "llama3")
    convs = CONVERSATIONS[:2]
    assert prepare(tmp_path, "llama3", [write_jsonl(tmp_path / "a.jsonl", convs)], name="openai").returncode == 0
    assert prepare(tmp_path, "llama3", [write_jsonl(tmp_path / "b.jsonl", convs, sharegpt=True)],
                   name="sharegpt").returncode == 0
    assert read_indexed(tmp_path / "openai") == read_indexed(tmp_path / "sharegpt")
    p = prepare(tmp_path, "llama3", [tmp_path / "a.jsonl"], "--train-on", "last", name="last")
    assert p.returncode == 0, p.stderr
    tok, raw = tokenizers["llama3"]
    for conv, doc in zip(convs, read_indexed(tmp_path / "last")):
        ids, mask = ids_and_mask(doc)
        rendered = tok.apply_chat_template(conv, tokenize=False)
        assert (ids, mask) == reference(rendered, conv, "llama3", raw, last_only=True)


def test_overlong_conversations_truncate_or_split_at_a_user_turn(tmp_path, hf):
    tokenizers, root = hf
    (tmp_path / "tok").symlink_to(root / "llama3")
    conv = CONVERSATIONS[0]
    src = write_jsonl(tmp_path / "c.jsonl", [conv])
    assert prepare(tmp_path, "llama3", [src], name="whole").returncode == 0
    whole, _ = ids_and_mask(read_indexed(tmp_path / "whole")[0])
    start = tokenizers["llama3"][1].token_to_id("<|start_header_id|>")
    user = tokenizers["llama3"][1].encode("user", add_special_tokens=False).ids
    turns = [i for i in range(len(whole)) if whole[i] == start and whole[i + 1:i + 1 + len(user)] == user]
    assert len(turns) == 2
    cap = turns[1] + 3  # the first exchange fits, the second does not
    assert cap < len(whole)
    p = prepare(tmp_path, "llama3", [src], "--max-tokens", str(cap), name="trunc")
    assert p.returncode == 0, p.stderr
    (doc,) = read_indexed(tmp_path / "trunc")
    assert ids_and_mask(doc)[0] == whole[:cap]
    assert json.loads((tmp_path / "trunc.manifest.json").read_text())["overlong_conversations"]["truncated"] == 1
    p = prepare(tmp_path, "llama3", [src], "--max-tokens", str(cap), "--overlong", "split", name="split")
    assert p.returncode == 0, p.stderr
    pieces = [ids_and_mask(d)[0] for d in read_indexed(tmp_path / "split")]
    assert pieces == [whole[:turns[1]], whole[turns[1]:]], [len(x) for x in pieces]
    assert json.loads((tmp_path / "split.manifest.json").read_text())["overlong_conversations"]["split"] == 1


def test_bad_conversations_follow_on_error(tmp_path, hf):
    _, root = hf
    (tmp_path / "tok").symlink_to(root / "chatml")
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    lines = [json.dumps(good),
             json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
             json.dumps({"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}),
             "{not json",
             json.dumps(good)]
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    p = prepare(tmp_path, "chatml", [src])
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert f"{src}:2: the conversation has no assistant turn" in p.stderr, p.stderr
    assert not (tmp_path / "chat.bin").exists() and not (tmp_path / "chat.manifest.json").exists()
    p = prepare(tmp_path, "chatml", [src], "--on-error", "skip")
    assert p.returncode == 0, p.stderr
    assert "skipped 3 malformed records" in p.stdout, p.stdout
    assert f"{src}:3: messages[0]: expected an object with a string \"role\"" in p.stderr, p.stderr
    assert f"{src}:4: not a JSON object" in p.stderr
    assert len(read_indexed(tmp_path / "chat")) == 2
    assert json.loads((tmp_path / "chat.manifest.json").read_text())["skipped_records"] == 3
    # A tokenizer without the template's tokens: refused before anything is read, naming the token.
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(str(root / "chatml" / "tokenizer.json"))
    j = json.loads(t.to_str())
    j["added_tokens"] = [a for a in j["added_tokens"] if a["content"] != "<|eot_id|>"]
    (tmp_path / "lacking").mkdir()
    (tmp_path / "lacking" / "tokenizer.json").write_text(json.dumps(j))
    p = subprocess.run([nnstrain_bin_path(), "prepare", "corpus", "--format", "chat", "--chat-template", "llama3",
                        "--tokenizer", str(tmp_path / "lacking"), "--input", str(src), "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--chat-template: chat template llama3 needs the special token <|eot_id|>" in p.stderr, \
        p.stderr
    p = prepare(tmp_path, "vicuna", [src])
    assert p.returncode == 2 and "chat template 'vicuna' is not known" in p.stderr, p.stderr
