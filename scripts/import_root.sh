#!/usr/bin/env bash
# Make <checkout>/.import-root: the checkout's packages under their import names (symlinks), for
# PYTHONPATH. The cached environments are shared between checkouts and their editable install
# points at whichever checkout set them up last; a process with this folder first on its path
# imports this checkout's code whatever another checkout did meanwhile. Prints the folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/.import-root"
mkdir -p "$dir"
ln -sfn ../common "$dir/delta_swap"
ln -sfn ../vllm_delta_plugin "$dir/vllm_delta_plugin"
ln -sfn ../sglang_delta_plugin "$dir/sglang_delta_plugin"
# The engines find the plugin through entry points; a dist-info here, first on the path, shadows
# the shared environment's (importlib.metadata keeps the first distribution of a name).
meta="$dir/delta_swap.dist-info"
mkdir -p "$meta"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -1)
# Written beside and renamed over (a server starting meanwhile reads the old file or the new one).
printf 'Metadata-Version: 2.1\nName: delta-swap\nVersion: %s\n' "$version" > "$meta/METADATA.$$"
mv -f "$meta/METADATA.$$" "$meta/METADATA"
awk '/^\[/ { on = 0 }
     /^\[project\.entry-points\./ { g = $0; sub(/^\[project\.entry-points\."?/, "", g); sub(/"?\]$/, "", g);
                                    print "[" g "]"; on = 1; next }
     on && /=/ { gsub(/"/, ""); print }' "$root/pyproject.toml" > "$meta/entry_points.txt.$$"
mv -f "$meta/entry_points.txt.$$" "$meta/entry_points.txt"
echo "$dir"
