#!/usr/bin/env bash
# The deploy/ checks that ctest runs (tests/deploy/CMakeLists.txt); each is
# also a command to run by hand from the repository root:
#   check.sh render   OVERLAY            kubectl kustomize renders it
#   check.sh validate OVERLAY            schema validation (tools/k8s-validate.js)
#   check.sh flags    OVERLAY BIN_DIR    flag drift (tools/k8s-flags.js)
#   check.sh durable  OVERLAY            restarts (podFailurePolicy, per-index
#                                        retries), grace periods and the shared
#                                        checkpoints claim (tests/deploy/durable.js)
#   check.sh restricted OVERLAY          Pod Security "restricted", read-only
#                                        roots (tests/deploy/restricted.js)
#   check.sh schedule OVERLAY            one size, Jobs with TTLs and a Kueue
#                                        queue, priority, Guaranteed QoS, probes,
#                                        images (tests/deploy/schedule.js)
#   check.sh secure   OVERLAY            the job secret in every pod, the
#                                        NetworkPolicy, nothing bound wider
#                                        (tests/deploy/secure.js, against
#                                        deploy/k8s/make-secret --dry-run)
#   check.sh dashboard JSON              a Grafana dashboard: panels laid out,
#                                        datasource, only the metrics and labels
#                                        that coordinator/job_metrics.cc defines
#                                        (tests/deploy/dashboard.js; no kubectl),
#                                        its PromQL parsed by promtool where found
#   check.sh expect-fail dashboard-promql JSON REGEX
#                                        as expect-fail dashboard, but skipped
#                                        where promtool is not installed
#   check.sh make-secret                 make-secret draws a new 64-hex-digit
#                                        secret each time
#   check.sh yamllint                    yamllint --strict on deploy/
#   check.sh expect-fail validate|flags|durable|secure|restricted|schedule|dashboard OVERLAY|JSON [BIN_DIR] REGEX
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

# The value of key $2 (base64-decoded) of the Secret manifest $1.
secret_value() {
  sed -n "s/^  $2: //p" "$1" | base64 -d
}

# run_check validate|flags|durable|secure|restricted|schedule OVERLAY [BIN_DIR]: prints the
# check's output, returns its status.
run_check() {
  local what=$1 overlay=$2 rendered status=0
  if [ "$what" = dashboard ] || [ "$what" = dashboard-promql ]; then
    node tests/deploy/dashboard.js --metrics coordinator/job_metrics.cc --metrics server/server_metrics.cc \
      --metrics worker/worker_metrics.cc "$overlay" || status=$?
    return $status
  fi
  rendered=$(kubectl kustomize "$overlay") || return 2
  case $what in
    validate) node tools/k8s-validate.js <<<"$rendered" || status=$? ;;
    flags) node tools/k8s-flags.js --bin-dir "$3" --dockerfile deploy/docker/Dockerfile \
             <<<"$rendered" || status=$? ;;
    durable) node tests/deploy/durable.js <<<"$rendered" || status=$? ;;
    restricted) node tests/deploy/restricted.js <<<"$rendered" || status=$? ;;
    schedule) node tests/deploy/schedule.js <<<"$rendered" || status=$? ;;
    secure)
      local secret
      secret=$(mktemp)
      deploy/k8s/make-secret --dry-run >"$secret" || { rm -f "$secret"; return 2; }
      node tests/deploy/secure.js --secret "$secret" <<<"$rendered" || status=$?
      rm -f "$secret"
      ;;
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
  validate | flags | durable | secure | restricted | schedule)
    need_kubectl
    run_check "$cmd" "$@"
    ;;
  dashboard)
    run_check dashboard "$1"
    ;;
  make-secret)
    need_kubectl
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    deploy/k8s/make-secret --dry-run >"$tmp/a.yaml"
    deploy/k8s/make-secret --dry-run >"$tmp/b.yaml"
    a=$(secret_value "$tmp/a.yaml" job-secret)
    b=$(secret_value "$tmp/b.yaml" job-secret)
    if ! grep -Eqx '[0-9a-f]{64}' <<<"$a"; then
      echo "FAIL: make-secret's job-secret is not 64 hex digits: '$a'"
      exit 1
    fi
    if [ "$a" = "$b" ]; then
      echo "FAIL: make-secret drew the same secret twice"
      exit 1
    fi
    if ! grep -q '^  name: onebit-job-secret$' "$tmp/a.yaml"; then
      echo "FAIL: make-secret's Secret is not onebit-job-secret:"
      cat "$tmp/a.yaml"
      exit 1
    fi
    echo "make-secret: a new 64-hex-digit secret each time, in Secret onebit-job-secret"
    ;;
  yamllint)
    yamllint --strict -c deploy/.yamllint deploy
    echo "yamllint: deploy/ clean"
    ;;
  expect-fail)
    what=$1 overlay=$2
    regex=${*: -1}
    case $what in
      dashboard) ;;
      dashboard-promql)
        if ! command -v promtool >/dev/null; then
          echo "SKIP: promtool (Debian's prometheus) is not installed, so PromQL cannot be parsed"
          exit 77
        fi
        ;;
      *) need_kubectl ;;
    esac
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
  -h | --help)
    sed -n '2,32p' "$0"
    ;;
  *)
    sed -n '2,32p' "$0" >&2
    exit 2
    ;;
esac
