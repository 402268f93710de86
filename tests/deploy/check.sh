#!/usr/bin/env bash
# The deploy/ checks that ctest runs (tests/deploy/CMakeLists.txt); each is
# also a command to run by hand from the repository root:
#   check.sh render   OVERLAY            kubectl kustomize renders it
#   check.sh validate OVERLAY            schema validation (tools/k8s-validate.js)
#   check.sh flags    OVERLAY BIN_DIR    flag drift (tools/k8s-flags.js)
#   check.sh durable  OVERLAY            restarts and the shared checkpoints claim
#                                        (tests/deploy/durable.js)
#   check.sh yamllint                    yamllint --strict on deploy/
#   check.sh expect-fail validate|flags|durable OVERLAY [BIN_DIR] REGEX
#                                        that check exits 1 and prints REGEX
# Exit 77 (ctest: skipped) with a printed reason where kubectl is absent.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

need_kubectl() {
  if ! command -v kubectl >/dev/null; then
    echo "SKIP: kubectl is not installed, so the manifests cannot be rendered"
    exit 77
  fi
}

render() {
  need_kubectl
  kubectl kustomize "$1"
}

# run_check validate|flags|durable OVERLAY [BIN_DIR]: prints the check's output, returns its status.
run_check() {
  local what=$1 overlay=$2 rendered status=0
  rendered=$(kubectl kustomize "$overlay") || return 2
  case $what in
    validate) node tools/k8s-validate.js <<<"$rendered" || status=$? ;;
    flags) node tools/k8s-flags.js --bin-dir "$3" --dockerfile deploy/docker/Dockerfile \
             <<<"$rendered" || status=$? ;;
    durable) node tests/deploy/durable.js <<<"$rendered" || status=$? ;;
    *) echo "unknown check $what" >&2; return 2 ;;
  esac
  return $status
}

cmd=${1:-}
shift || true
case $cmd in
  render)
    need_kubectl
    out=$(render "$1")
    n=$(grep -c '^kind: ' <<<"$out" || true)
    echo "$1: $n objects"
    ((n > 0))
    ;;
  validate | flags | durable)
    need_kubectl
    run_check "$cmd" "$@"
    ;;
  yamllint)
    yamllint --strict -c deploy/.yamllint deploy
    echo "yamllint: deploy/ clean"
    ;;
  expect-fail)
    what=$1 overlay=$2
    regex=${*: -1}
    need_kubectl
    status=0
    out=$(run_check "${@:1:$#-1}" 2>&1) || status=$?
    echo "$out"
    if ((status != 1)); then
      echo "FAIL: expected '$what' to exit 1 on $overlay, got $status"
      exit 1
    fi
    if ! grep -Eq -- "$regex" <<<"$out"; then
      echo "FAIL: '$what' failed on $overlay, but did not print /$regex/"
      exit 1
    fi
    echo "ok: '$what' rejects $overlay with /$regex/"
    ;;
  *)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
