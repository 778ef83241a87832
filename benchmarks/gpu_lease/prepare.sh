#!/usr/bin/env bash
# Builds, here (a machine that reaches the package index), everything a GPU lease carries, all of it
# git-ignored: .gpu/site.tar.xz (ray[serve], our transformers pin, gguf, the openai and anthropic
# clients), .gpu/smollm2-files (the default model's config and tokenizer, no weights), .fa4/ (the
# FlashAttention-4 wheels in parts of at most 60 MiB) and, with --vllm, .vllm/ (vLLM 0.26.0's 14 parts).
#
#   bash benchmarks/gpu_lease/prepare.sh [--vllm]        # from the repository root, in the project's venv
#
# README.md beside this script says how a lease sends them and what runs there.
set -euo pipefail
[ -f pyproject.toml ] || { echo "run from the repository root" >&2; exit 2; }
SHARED=${SHARED:-../shared/offline}
for dir in .gpu .fa4 .vllm; do
  grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
done
pin=$(python3 -c "import transformers; print(transformers.__version__)")
TRANSFORMERS_REQ="transformers==$pin" bash "$SHARED/build_site_bundle.sh" .gpu openai anthropic
[ -d .gpu/smollm2-files ] || python3 benchmarks/random_checkpoint.py export .gpu/smollm2-files

# FlashAttention-4 and the CuTe DSL it compiles with; the image has torch, einops and cuda-bindings,
# and the cu12 libraries are left out (the machine runs CUDA 13).
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform any -d "$work/wheels" \
  flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1
mkdir -p .fa4 && rm -f .fa4/part_* .fa4/SHA256SUMS
tar -C "$work" -cf "$work/fa4.tar" wheels
split -b 60M "$work/fa4.tar" .fa4/part_
( cd .fa4 && sha256sum part_* ) > .fa4/SHA256SUMS

if [ "${1:-}" = --vllm ]; then bash "$SHARED/vllm/build_vllm_parts.sh" .vllm; fi
ls -la .gpu .fa4 ${1:+.vllm}
