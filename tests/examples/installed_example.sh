#!/usr/bin/env bash
# The C++ example as an outside project: install onebit-ps into a prefix,
# build examples/cpp against it with find_package(onebit), and train its own
# model on a 4 x 2 cluster with the installed onebit-launch.
#   installed_example.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1
build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
cmake -S "$src/examples/cpp" -B "$tmp/example" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/example" >/dev/null
"$tmp/prefix/bin/onebit-launch" --workers 4 --servers 2 --model external \
  --optimizer onebit-adam --freeze_step 20 --lr 0.005 --out "$tmp/run" \
  --worker_cmd "$tmp/example/softmax_train --steps 60 --batch 32 --max_train 4000" \
  >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
summary=$(cat "$tmp/run/summary.json")
fail() { echo "installed_example: $1"; cat "$tmp/log"; echo "$summary"; exit 1; }
grep -q '"replicas_equal": true' <<<"$summary" || fail "replicas differ"
grep -q '"status": "ok"' <<<"$summary" || fail "job not ok"
grep -q '"params": 7850' <<<"$summary" || fail "wrong d"
grep -q '"steps": 60' <<<"$summary" || fail "wrong step count"
acc=$(grep -o 'test accuracy [0-9.]*' "$tmp/log" | awk '{print $3}')
# Softmax regression reaches ~0.7 on Fashion-MNIST within 60 small steps;
# a broken update stays near chance (0.1).
awk -v a="$acc" 'BEGIN { exit !(a > 0.5) }' || fail "test accuracy $acc"
echo "installed_example: ok (test accuracy $acc)"
