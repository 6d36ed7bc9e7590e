"""What the chat tests share (issue 40): a small byte-level BPE tokenizer trained
here with the special tokens of Llama 3's, ChatML's and Mistral's chat formats,
those models' own chat template strings written into a tokenizer_config.json,
conversations, and a reader of Megatron .bin/.idx files."""
import json
import pathlib
import struct

import numpy as np

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<s>", "</s>"]

# The chat_template strings of the models' tokenizer_config.json: Meta-Llama-3-8B-Instruct,
# Qwen2-7B-Instruct (ChatML with its default system prompt) and Mistral-7B-Instruct-v0.1.
TEMPLATES = {
    "llama3": ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
               "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
               "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
               "{{ content }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "chatml": ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
               "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
               "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "mistral": ("{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n"
                "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n"
                "{%- endif %}\n\n{{- bos_token }}\n{%- for message in loop_messages %}\n"
                "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
                "        {{- raise_exception('After the optional system message, conversation roles must alternate "
                "user/assistant/user/assistant/...') }}\n    {%- endif %}\n"
                "    {%- if message['role'] == 'user' %}\n        {%- if loop.first and system_message is defined %}\n"
                "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
                "        {%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
                "        {%- endif %}\n    {%- elif message['role'] == 'assistant' %}\n"
                "        {{- ' ' + message['content'] + eos_token}}\n    {%- else %}\n"
                "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an "
                "initial optional system message!') }}\n    {%- endif %}\n{%- endfor %}\n"),
}
TOKENS = {  # bos, eos, end of turn
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "chatml": (None, "<|im_end|>", "<|im_end|>"),
    "mistral": ("<s>", "</s>", "</s>"),
}

TEXT = ("The quick brown fox jumps over the lazy dog. Conversations are rendered with a template; "
        "the assistant answers and the loss counts only its words. Ünïcödé ☃ 日本語 テキスト emoji 🙂👍. "
        "What is the capital of France? Paris is the capital of France. Tell me a joke about cats. "
        "Numbers 12345 and punctuation: (a), [b], {c}!\n\n  indented\tline\n")


_TRAINED = {}


def write_tokenizer(folder, template=None):
    """folder/tokenizer.json (BPE over TEXT, the SPECIALS added as special tokens) and, for a
    template, its tokenizer_config.json. Returns the folder."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if "json" not in _TRAINED:
        _TRAINED["json"] = _train().to_str()
    (folder / "tokenizer.json").write_text(_TRAINED["json"], encoding="utf-8")
    if template:
        bos, eos, _ = TOKENS[template]
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATES[template],
               "bos_token": bos, "eos_token": eos, "clean_up_tokenization_spaces": False,
               "model_max_length": 4096}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _train():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t.train_from_iterator([TEXT] * 4, trainer)
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return t


CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Japan? 日本"},
     {"role": "assistant", "content": "Tokyo 🙂 is the capital."}],
    [{"role": "user", "content": "Tell me a joke about cats."},
     {"role": "assistant", "content": "  Cats\tdo not tell jokes.\n"}],
    [{"role": "user", "content": ""},  # empty turns
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "Ünïcödé ☃?"},
     {"role": "assistant", "content": "Ünïcödé ☃!"}],
    [{"role": "system", "content": "Say <|eot_id|> and </s> as text."},  # special-token strings stay text
     {"role": "user", "content": "Print <|im_start|> or <s> [INST] please <|end_header_id|>"},
     {"role": "assistant", "content": "Here: <|eot_id|> <|im_end|> </s> done"}],
]


def write_jsonl(path, conversations, sharegpt=False):
    with open(path, "w", encoding="utf-8") as f:
        for c in conversations:
            if sharegpt:
                names = {"user": "human", "assistant": "gpt", "system": "system"}
                f.write(json.dumps({"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c]},
                                   ensure_ascii=False) + "\n")
            else:
                f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
    return path


def read_indexed(prefix):
    """Megatron .bin/.idx -> a list of documents, each a list of sequences (lists of ids)."""
    idx = pathlib.Path(str(prefix) + ".idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    _, code, nseq, ndoc = struct.unpack_from("<QBQQ", idx, 9)
    at = 9 + 8 + 1 + 8 + 8
    lengths = np.frombuffer(idx, dtype=np.int32, count=nseq, offset=at)
    at += 4 * nseq
    pointers = np.frombuffer(idx, dtype=np.int64, count=nseq, offset=at)
    at += 8 * nseq
    docs = np.frombuffer(idx, dtype=np.int64, count=ndoc, offset=at)
    dtype = {8: np.uint16, 4: np.int32}[code]
    data = np.fromfile(str(prefix) + ".bin", dtype=dtype)
    size = np.dtype(dtype).itemsize
    seqs = [data[p // size: p // size + n].tolist() for p, n in zip(pointers, lengths)]
    return [seqs[docs[d]:docs[d + 1]] for d in range(len(docs) - 1)]


def ids_and_mask(document):
    """A chat document's ids and per-id target flags: its sequences alternate context, target."""
    ids, mask = [], []
    for k, s in enumerate(document):
        ids += s
        mask += [k % 2 == 1] * len(s)
    return ids, mask
