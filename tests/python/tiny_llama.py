"""The tiny random Llama the TRL tests train (word-level tokenizer, nothing
downloaded), saved to a folder that from_pretrained loads."""
from __future__ import annotations


def save_tiny_llama(d, V, eos_scale=1.0):
    """Model and tokenizer with vocabulary V into d. The embeddings are scaled
    by 4 (logits of a few units: ratios and entropies of real spread); the eos
    row by eos_scale more, which makes completions end early (ragged)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V - 3)}
    vocab.update({"<pad>": V - 3, "<eos>": V - 2, "<unk>": V - 1})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      pad_token_id=V - 3, eos_token_id=V - 2, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
        if eos_scale != 1.0:
            model.model.embed_tokens.weight[V - 2].mul_(eos_scale)
    model.save_pretrained(d)
    tok.save_pretrained(d)
