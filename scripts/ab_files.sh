#!/bin/bash
# Another revision's copies of some of this tree's files, for scripts/gpu_session.sh's `ab`
# part to measure against the tree side by side on one machine: `scripts/ab_files.sh REV
# PATH...` writes each PATH as it is at REV under .ab/ (its revision in .ab/REV; git-excluded
# like the wheels), which a device call then carries (carry: .ab).
set -eu
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: scripts/ab_files.sh REV PATH..." >&2; exit 2; }
rev=$1
shift
grep -qx "/.ab/" .git/info/exclude 2>/dev/null || echo "/.ab/" >> .git/info/exclude
rm -rf .ab
for path in "$@"; do
  mkdir -p ".ab/$(dirname "$path")"
  git show "$rev:$path" > ".ab/$path"
done
git rev-parse --short "$rev" > .ab/REV
echo "$# file(s) as at $(cat .ab/REV) in .ab/: carry .ab, then AB_PARTS=\"...\" scripts/gpu_session.sh ab"
