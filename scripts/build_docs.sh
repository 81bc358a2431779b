#!/usr/bin/env bash
# Build the user guide (mkdocs.yml, docs/) with every warning an error: mkdocs build --strict.
# Installs nothing: run it where the docs extra is installed (pip install ".[docs]"), with $PYTHON or python.
# The API reference is read from the sources in this checkout (mkdocstrings: paths [.]), so the
# package need not be built for it. The site goes to a temporary folder, removed on exit, unless a
# folder is given: scripts/build_docs.sh [SITE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -gt 0 ]]; then
  site="$1"
else
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
fi
# Material for MkDocs prints a notice about MkDocs 2.0 on every build; it is not a warning of this site.
export NO_MKDOCS_2_WARNING=1
"${PYTHON:-python}" -m mkdocs build --strict --clean --config-file mkdocs.yml --site-dir "$site"
