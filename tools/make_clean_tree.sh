#!/bin/sh
# Export HEAD into .clean/ so a device run tests committed code only,
# not whatever other engineers have uncommitted in the working tree. .clean/ is git-excluded.
set -e
cd "$(git rev-parse --show-toplevel)"
rm -rf .clean && mkdir .clean
git archive HEAD ninfer-core ninfer-convert ninfer-qwen3_5 ninfer-qwen4exp ninfer-serve tools tests pyproject.toml \
  | tar -x -C .clean
git rev-parse HEAD > .clean/COMMIT
du -sh .clean
