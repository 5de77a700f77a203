"""Build a tiny Llama-shaped model and its tokenizer locally.

Nothing is fetched from a model hub: the tokenizer is a byte-level BPE
trained on a few sentences, the weights are random from a fixed seed,
float32. The result is a directory `vllm serve` loads like any model.

    python make_tiny_model.py OUT_DIR           # 2-layer Llama, float32 (the CPU tests)
    python make_tiny_model.py --qwen3 OUT_DIR   # 4 layers of Qwen3-8B's attention shape, bfloat16

The --qwen3 model is for exactness on GPU vLLM: its KV per layer has the
8B's geometry (8 KV heads of 128) and its weights are ordinary random
initialisation, so what it generates depends on the KV it reads (unlike
--load-format dummy, whose uniform weights make the output depend on the
last token only).
"""

import argparse

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

CORPUS = [
    "hello world, this is a tiny model made for testing vllm-hi.",
    "the quick brown fox jumps over the lazy dog.",
    "tokens stream from one engine to another without a break.",
    "a migration moves the kv cache and the scheduler state.",
    "one two three four five six seven eight nine ten.",
] * 20


def main(out: str, qwen3: bool) -> None:
    torch.manual_seed(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    if qwen3:
        cfg = Qwen3Config(
            vocab_size=len(fast), hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
            bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
        )
        Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        fast.save_pretrained(out)
        return
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,  # vLLM's CPU attention kernels need a supported head size (16 is not)
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a tiny model and tokenizer, made locally")
    ap.add_argument("out")
    ap.add_argument("--qwen3", action="store_true", help="Qwen3 with the 8B's KV geometry, bfloat16")
    a = ap.parse_args()
    main(a.out, a.qwen3)
