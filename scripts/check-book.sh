#!/usr/bin/env bash
# Builds the book under docs/ with mdBook and checks every link in it with mdbook-linkcheck
# (links between pages, anchors, and links to the repository's files; web links are not
# fetched). Installs both from crates.io when missing, unoptimised in one target directory:
# a small book needs no optimised checker, and the two share most of their crates (5 min
# to build here instead of 7.7).
#
#   scripts/check-book.sh          (the HTML lands in docs/book/)
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.4.52
LINKCHECK_VERSION=0.7.7
install=(cargo install --locked --debug --target-dir target/book-tools)
if ! mdbook --version 2>/dev/null | grep -q "v$MDBOOK_VERSION"; then
  "${install[@]}" mdbook --version "$MDBOOK_VERSION" --no-default-features --features search
fi
if ! mdbook-linkcheck --version 2>/dev/null | grep -q "$LINKCHECK_VERSION"; then
  "${install[@]}" mdbook-linkcheck --version "$LINKCHECK_VERSION"
fi
mdbook build docs
