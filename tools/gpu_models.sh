# The two GGUFs a GPU-host run stages (their names in ~/.cache/edgespec/models; sha256 prefixes as `staged` in
# gpu_run.sh checks them), sourced by gpu_prepare.sh, gpu_stage_piece.sh and gpu_run.sh.
TARGET_GGUF=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
TARGET_SHA256=cc324af0
DRAFT_GGUF=qwen2.5-coder-0.5b-instruct.gguf
DRAFT_SHA256=1d961463
