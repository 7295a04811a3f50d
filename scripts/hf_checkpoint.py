#!/usr/bin/env python3
"""A small Hugging Face checkpoint with random weights, written by transformers: what `voodoo quantize DIR` is
tested on (tests/test_hf.cpp). Offline: the tokenizer is a SentencePiece model trained here on --text, since no
hub download is possible; llama.cpp's converter reads it for both architectures (LlamaModel and Qwen2Model try
tokenizer.model first). Every dimension is a multiple of 256, so every llama.cpp type fits; the weights are BF16.

Usage: python3 scripts/hf_checkpoint.py --arch llama|qwen3 --text FILE --out DIR
"""
import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["llama", "qwen3"], required=True)
    ap.add_argument("--text", required=True, help="text the tokenizer is trained on")
    ap.add_argument("--out", required=True, help="the checkpoint folder (made)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    import sentencepiece as spm
    import torch
    import transformers

    os.makedirs(a.out, exist_ok=True)
    # The tokenizer: 512 pieces with byte fallback, trained on the first 2 MB of the text.
    with open(a.text, encoding="utf-8", errors="replace") as f:
        sample = f.read(2_000_000)
    sample_path = os.path.join(a.out, ".tokenizer-sample.txt")
    with open(sample_path, "w", encoding="utf-8") as f:
        f.write(sample)
    spm.SentencePieceTrainer.train(input=sample_path, model_prefix=os.path.join(a.out, "tokenizer"), vocab_size=512,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2,
                                   unk_id=0, pad_id=-1, num_threads=1, minloglevel=2)
    os.remove(sample_path)
    os.remove(os.path.join(a.out, "tokenizer.vocab"))

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    # transformers 5 names the dtype `dtype`; 4.x `torch_dtype`.
    common["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = "bfloat16"
    if a.arch == "llama":
        config = transformers.LlamaConfig(**common, head_dim=64)
    else:
        config = transformers.Qwen3Config(**common, head_dim=64)
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():  # weights of a trained model's scale, not the init's tiny ones
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(a.out, safe_serialization=True)
    print(f"wrote {a.out}: {a.arch}, {sum(p.numel() for p in model.parameters())} weights, transformers "
          f"{transformers.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
