# Session 11 (2026-12-02), the 2-core development machine: the two recipes of docs/RESULTS.md "The Q5_K_M size".
# calib14.txt = wiki.valid.raw + the first 80% of the lines of tinystories_val.txt (RESULTS.md's calibration).
V=build/bin/voodoo
M=../shared/data/models/mix30M/mix30M.gguf
E=../shared/data/text/wikitext-2-raw/wiki.test.raw
common="--text calib14.txt --eval-text $E --ctx 512 --eval-ctx 512 --eval-chunks 40 --speed-reps 0 --work w14"
# e1: token_embd forced to Q8_0, every other tensor from the default menu, at stock Q5_K_M's size
$V quantize $M $common --like Q5_K_M --menu-for 'token_embd\.weight=Q8_0' --baselines Q5_K_S,Q5_K_M \
    --out e1-embd-q8-q5km-size.gguf > e1.log 2>&1
# e2: token_embd at Q6_K, every other tensor Q8_0 or BF16 (lossless or nearly), any size
$V quantize $M $common --target-size 41709000 --menu Q8_0,BF16 --menu-for 'token_embd\.weight=Q6_K' \
    --baselines Q5_K_S,Q5_K_M --out e2-embd-q6k-rest-bf16.gguf > e2.log 2>&1
