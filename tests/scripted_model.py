"""A tiny model whose greedy output is a script: a bigram model made by construction. Its layers
compute nothing (zero weights: each position's hidden state is its token's embedding), and its
output head maps each token of the script to the next one, so after a prompt ending in the
template's generation prompt the model writes the script's pieces (each made one token of the
tokenizer) and then EOS. A real HF-format LlamaForCausalLM: loaded and run by the real code path."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

SCALE = 20.0  # the right next token's logit over any other's: ~SCALE·sqrt(hidden) against ~SCALE


def make_scripted_model(out: Path, tokenizer_dir: str | Path, pieces: list[str],
                        starts: list[list[dict]] | None = None, chat_kwargs: dict | None = None) -> Path:
    """Save the model to ``out``: after the generation prompt of each chat in ``starts`` (default:
    one user message) it writes ``pieces`` then EOS. ``pieces`` must be distinct; each becomes one
    token (added to the tokenizer unless it is one already)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    new = [p for p in pieces if len(tok.encode(p, add_special_tokens=False)) != 1]
    tok.add_tokens([transformers.AddedToken(p, normalized=False, special=False) for p in new])
    ids = [tok.encode(p, add_special_tokens=False) for p in pieces]
    assert all(len(i) == 1 for i in ids), [p for p, i in zip(pieces, ids) if len(i) != 1]
    chain = [i[0] for i in ids]
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    heads = set()
    for chat in starts or [[{"role": "user", "content": "hi"}]]:
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **(chat_kwargs or {}))
        heads.add(tok.encode(prompt, add_special_tokens=False)[-1])
    links = [(h, chain[0]) for h in heads] + list(zip(chain, chain[1:])) + [(chain[-1], eos)]
    sources = [a for a, _ in links]
    assert len(set(sources)) == len(sources), "a token of the script would have two successors"
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=eos,
                                   dtype="float32")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
        model.model.embed_tokens.weight.copy_(emb)
        for a, b in links:
            model.lm_head.weight[b] += SCALE * emb[a] / emb[a].norm()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    gen = {"eos_token_id": eos, "bos_token_id": tok.bos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
