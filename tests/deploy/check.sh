#!/usr/bin/env bash
# The deploy/ checks that ctest runs (tests/deploy/CMakeLists.txt); each is
# also a command to run by hand from the repository root:
#   check.sh render   OVERLAY            kubectl kustomize renders it
#   check.sh validate OVERLAY            schema validation (tools/k8s-validate.js)
#   check.sh flags    OVERLAY BIN_DIR    flag drift (tools/k8s-flags.js)
#   check.sh yamllint                    yamllint --strict on deploy/
#   check.sh expect-fail validate|flags OVERLAY [BIN_DIR] REGEX
#                                        that check exits 1 and prints REGEX
#   check.sh pending OVERLAY PATCH KIND NAME FLAG BIN_DIR
#                                        a patch waiting for FLAG (see below)
#   check.sh pending-selftest (same arguments as pending)
#                                        pending fails once FLAG exists
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

# run_check validate|flags OVERLAY [BIN_DIR]: prints the check's output, returns its status.
run_check() {
  local what=$1 overlay=$2 rendered status=0
  rendered=$(kubectl kustomize "$overlay") || return 2
  case $what in
    validate) node tools/k8s-validate.js <<<"$rendered" || status=$? ;;
    flags) node tools/k8s-flags.js --bin-dir "$3" --dockerfile deploy/docker/Dockerfile \
             <<<"$rendered" || status=$? ;;
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
  validate | flags)
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
  pending)
    # A patch that passes a flag the binaries do not have yet lives in the
    # overlay's pending/ folder, not in its kustomization. This renders the
    # overlay with the patch: while FLAG is the only problem, the patch is
    # still pending (pass); once the flag exists it must be enabled (fail).
    overlay=$1 patch=$2 kind=$3 name=$4 flag=$5 bin_dir=$6
    if grep -Eq "^[[:space:]]*-?[[:space:]]*path:[[:space:]]*$patch[[:space:]]*$" \
         "$overlay/kustomization.yaml"; then
      echo "$overlay/$patch is enabled; the flags check covers it"
      exit 0
    fi
    need_kubectl
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    cp "$overlay/$patch" "$tmp/patch.yaml"
    cat >"$tmp/kustomization.yaml" <<EOK
resources:
  - $(realpath --relative-to="$tmp" "$root/$overlay")
patches:
  - path: patch.yaml
    target:
      kind: $kind
      name: $name
EOK
    status=0
    out=$(run_check flags "$tmp" "$bin_dir" 2>&1) || status=$?
    echo "$out"
    if ((status == 0)); then
      echo "FAIL: the binaries have --$flag now: enable $patch in $overlay/kustomization.yaml"
      exit 1
    fi
    problems=$(grep -v '^k8s-flags: ' <<<"$out" || true)
    if ((status == 1)) && [ -n "$problems" ] && ! grep -qv -- "--$flag: unknown flag" <<<"$problems"; then
      echo "pending: $overlay/$patch waits for --$flag"
      exit 0
    fi
    echo "FAIL: $overlay with $patch has problems other than the missing --$flag"
    exit 1
    ;;
  pending-selftest)
    # The pending check must notice the day FLAG appears: run it against
    # stand-ins of the binaries whose --helpfull also lists --FLAG.
    overlay=$1 patch=$2 kind=$3 name=$4 flag=$5 bin_dir=$(cd "$6" && pwd)
    need_kubectl
    fake=$(mktemp -d)
    trap 'rm -rf "$fake"' EXIT
    for b in "$bin_dir"/onebit-*; do
      [ -x "$b" ] && [ -f "$b" ] || continue
      printf '#!/bin/sh\n"%s" "$@" 2>&1\necho "    --%s (stand-in for the check); default: \\"\\";"\n' \
        "$b" "$flag" >"$fake/$(basename "$b")"
      chmod +x "$fake/$(basename "$b")"
    done
    status=0
    out=$("$0" pending "$overlay" "$patch" "$kind" "$name" "$flag" "$fake" 2>&1) || status=$?
    echo "$out"
    if ((status == 1)) && grep -q "enable $patch" <<<"$out"; then
      echo "ok: the pending check asks to enable $patch once --$flag exists"
      exit 0
    fi
    echo "FAIL: the pending check did not ask to enable $patch when --$flag existed (status $status)"
    exit 1
    ;;
  *)
    sed -n '2,15p' "$0" >&2
    exit 2
    ;;
esac
