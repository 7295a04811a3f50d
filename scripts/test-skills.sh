#!/usr/bin/env bash
# Runs every ```sh block of every skill (skills/*/SKILL.md) on stories260K, in the order an agent would use them
# (install, data, train, export, eval, quantize), in one shell with -euo pipefail, from the repository root, with
# WORK in a fresh temporary folder. Checks each skill's front matter (name, description) first. Exit 1 on the first
# failing block or malformed skill. Usage: scripts/test-skills.sh VOODOO_BIN SHARED_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
export VOODOO=${1:?the voodoo binary} SHARED=${2:?the shared folder (holding data/)}
export VOODOO_PROGRESS=0
WORK=$(mktemp -d /tmp/voodoo-skills.XXXXXX)
export WORK
trap 'rm -rf "$WORK"' EXIT
order=(install data train export eval quantize)
found=$(find skills -name SKILL.md | wc -l)
if [ "$found" != "${#order[@]}" ]; then
    echo "skills/ has $found SKILL.md files; this test runs ${#order[@]}: ${order[*]} (add the new one to its order)"
    exit 1
fi
for s in "${order[@]}"; do
    f=skills/$s/SKILL.md
    head -1 "$f" | grep -qx -- "---" || { echo "$f: no front matter"; exit 1; }
    grep -q "^name: voodoo-$s$" "$f" || { echo "$f: front matter has no 'name: voodoo-$s'"; exit 1; }
    grep -q "^description: ." "$f" || { echo "$f: front matter has no description"; exit 1; }
    script=$WORK/$s.sh
    awk '/^```sh$/{f=1; next} /^```$/{f=0} f' "$f" > "$script"
    [ -s "$script" ] || { echo "$f: no sh command block"; exit 1; }
    echo "== skill $s ($(grep -c . "$script") lines)"
    if ! bash -euo pipefail "$script" > "$WORK/$s.log" 2>&1; then
        echo "$f: a command failed:"; tail -20 "$WORK/$s.log"; exit 1
    fi
done
echo "every command block of ${#order[@]} skills ran"
