"""Text in and out: tokenizers, chat rendering with token ownership, and parsing the model's output.

- `tokenizer`: the `Tokenizer` wrapper, and the offline o200k (GPT-OSS) vocabulary; `bpe` builds byte-level
  BPE tokenizers from merges.
- `chat`: render a message list once with the model's chat template, every token owned by its message
  (`chat_template` holds the Jinja environment and the hooks that track ownership).
- `parsers`: split generated text into reasoning, content and tool calls (harmony, MiniMax-M2 XML).
"""
