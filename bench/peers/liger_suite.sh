#!/usr/bin/env bash
# Liger-Kernel's own GRPO test suite (test/chunked_loss/test_grpo_loss.py of the
# installed liger-kernel's sdist, from PyPI) with fusedgrpo's module in place of
# LigerFusedLinearGRPOLoss: the same tests, our numbers. Prints pytest's summary
# and the failures grouped by test; python/README.md ("Where Liger departs from
# TRL 1.16") says which failures are Liger's departures from TRL.
#   PYTHON=python3   FG_LIGER_SUITE_DIR=/tmp/fg_liger_suite
set -euo pipefail
py="${PYTHON:-python3}"
ver=$("$py" -c "import importlib.metadata as m; print(m.version('liger-kernel'))")
dir="${FG_LIGER_SUITE_DIR:-/tmp/fg_liger_suite}"
rm -rf "$dir" && mkdir -p "$dir"
"$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  "liger-kernel==$ver" -d "$dir" >/dev/null
tar xzf "$dir"/liger_kernel-"$ver".tar.gz -C "$dir"
root="$dir/liger_kernel-$ver"
suite="$root/test/chunked_loss/test_grpo_loss.py"
# The one substitution: the module under test.
sed -i 's/^from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss$/from fusedgrpo.torch import FusedLinearGRPOLoss as LigerFusedLinearGRPOLoss/' "$suite"
grep -q "from fusedgrpo.torch import FusedLinearGRPOLoss as LigerFusedLinearGRPOLoss" "$suite"
cd "$root"
set +e
"$py" -m pytest -q -p no:cacheprovider -x --co -q test/chunked_loss/test_grpo_loss.py >/dev/null 2>&1
"$py" -m pytest -q -p no:cacheprovider -rf test/chunked_loss/test_grpo_loss.py "$@" \
  > "$dir/pytest.log" 2>&1
rc=$?
set -e
tail -1 "$dir/pytest.log"
echo "failures by test (log: $dir/pytest.log):"
grep '^FAILED' "$dir/pytest.log" | sed 's/^FAILED [^:]*::\([a-z_]*\).*/\1/' | sort | uniq -c || true
exit 0
