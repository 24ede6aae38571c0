#!/usr/bin/env bash
# The notebooks under nbval, twice: on the package, and through the notebooks' learner switch
# on the reference copies in solutions/. The two passes run at once, one per core (each
# notebook writes only into its own temporary directories), each into its own log, printed
# when both are done; the script fails if either pass failed.
#     bash scripts/test_notebooks.sh PYTHON
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python}
logs=$(mktemp -d)
nbval=(-m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg notebooks)
# One thread each: two passes on two cores, not four threads fighting for them.
OMP_NUM_THREADS=1 "$PY" "${nbval[@]}" > "$logs/package.log" 2>&1 &
package=$!
OMP_NUM_THREADS=1 MINIVLLM_LEARNER=solutions "$PY" "${nbval[@]}" > "$logs/solutions.log" 2>&1 &
solutions=$!
wait $package; package_rc=$?
wait $solutions; solutions_rc=$?
echo "== notebooks on the package (exit $package_rc)"; cat "$logs/package.log"
echo "== notebooks on solutions/ (exit $solutions_rc)"; cat "$logs/solutions.log"
rm -rf "$logs"
[ $package_rc -eq 0 ] && [ $solutions_rc -eq 0 ]
