#!/usr/bin/env bash
# The user guide as a site, built in strict mode (mkdocs.yml): a broken link or anchor, a page missing from the
# nav or a nav entry without a page, or a docstring the API reference cannot render fails CI.
# Installs the `docs` extra's requirements into the active virtual environment (.ci/run's); the package and its
# tests never need them. Never pass -q to mkdocs: it hides the warnings, and strict mode then lets them through.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# The extra's requirements only: reinstalling the package itself could rebuild the extension that .ci/run built in
# place (mkdocstrings reads the sources, it imports nothing).
mapfile -t reqs < <(python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
python -m pip install -q "${reqs[@]}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --site-dir "$out"
# A Sphinx role in a docstring (:func:`init`) is not an error to mkdocstrings, which renders it raw: fail on one.
if grep -rnoE ':(py:)?(func|class|meth|mod|attr|data|exc|obj|const|ref):(`|<code>)[^<`]*' "$out" --include=*.html; then
  echo "ci: the API reference shows raw Sphinx roles (above); write \`\`name\`\` in the docstrings instead"; exit 1
fi
echo "ci: docs built (strict) in $(( $(date +%s) - start ))s"
