#!/usr/bin/env node
// Security wiring of rendered manifests (tests/deploy/check.sh secure OVERLAY):
//   kubectl kustomize deploy/k8s/overlays/gpu |
//     node tests/deploy/secure.js [--secret SECRET.yaml] [-]
// Asserts what deploy/README.md ("Securing a job") promises:
// - every coordinator, server and worker container gets the job secret: its
//   env sets ONEBIT_SECRET_FILE (or its args --secret_file) to a file of a
//   Secret volume that it mounts read-only, with no permission bits for
//   other users and not optional, the same Secret in every pod; none runs
//   --insecure;
// - that Secret is not in the manifests (it would be committed): with
//   --secret (deploy/k8s/make-secret --dry-run's output), it is that Secret
//   and has the key the file names;
// - a NetworkPolicy selects the pods of each role, and every ingress rule
//   of one admits only the job's own pods (podSelector peers that select
//   the job's pod templates: no ipBlock, no namespaceSelector, no empty
//   selector, no rule without `from` or `ports`; a rule for the health port
//   alone may admit an ipBlock other than everything, the nodes' addresses
//   for the kubelet's probes where the CNI filters them; a rule for the
//   metrics port (--metrics_port, the container port named metrics) alone
//   may admit a scraper's pods in another namespace, each peer a non-empty
//   namespaceSelector AND a non-empty podSelector, no ipBlock); the
//   coordinator's gRPC port (--port) is admitted from the servers and the
//   workers, the servers' data port (--data_port) from the workers, and a
//   --metrics_port from such a scraper;
// - egress is denied by default: a NetworkPolicy with Egress selects the
//   pods of each role, and every egress rule of one admits only the job's
//   own pods or the cluster's DNS (kube-system's kube-dns, port 53 alone);
//   the job's own connections (servers and workers to the coordinator's
//   --port, workers to the servers' --data_port, the coordinator to the
//   servers' and workers' --health_port) and DNS are admitted;
// - a --metrics_port is the container port named metrics and the pod's
//   prometheus.io/port annotation (where it has one), and every PodMonitor
//   selects the job's pods on such a port;
// - no pod uses hostNetwork or a hostPort, and no Service is a NodePort or
//   LoadBalancer or has externalIPs.
// Exit 0: all fine; 1: a problem, printed as "<Kind>/<name> <container>:
// <what>"; 2: usage or input errors.
'use strict';

const path = require('path');
const {start, readDocuments, isObject} = require('../../tools/k8s-common');

const die = start('secure');
const args = process.argv.slice(2);
const files = [];
let secretFile = null;
for (let i = 0; i < args.length; i++) {
  if (args[i] === '--secret') secretFile = args[++i];
  else if (args[i] === '-' || !args[i].startsWith('--')) files.push(args[i]);
  else die(`unknown option ${args[i]}`);
}
if (files.length === 0) files.push('-');
const docs = readDocuments(files, die).map((d) => d.doc).filter(isObject);
let generated = null;
if (secretFile) {
  generated = readDocuments([secretFile], die).map((d) => d.doc).find((d) => isObject(d) && d.kind === 'Secret');
  if (!generated) die(`${secretFile}: no Secret`);
}

const problems = [];
const nameOf = (obj) => `${obj.kind}/${obj.metadata && obj.metadata.name}`;
const ROLES = ['onebit-coordinator', 'onebit-server', 'onebit-worker'];

function podSpecOf(obj) {
  const s = obj.spec || {};
  if (obj.kind === 'Pod') return {spec: s, labels: (obj.metadata || {}).labels || {}};
  if (s.template && s.template.spec) {
    return {spec: s.template.spec, labels: (s.template.metadata || {}).labels || {}};
  }
  return null;
}

// The value of --name=V / --name V (dash or underscore spelling) in argv, or undefined.
function flagValue(argv, name) {
  for (let i = 0; i < argv.length; i++) {
    const m = argv[i].match(/^--?([A-Za-z0-9_-]+)(?:=(.*))?$/);
    if (!m || m[1].replace(/-/g, '_') !== name) continue;
    return m[2] !== undefined ? m[2] : argv[i + 1];
  }
  return undefined;
}
const hasFlag = (argv, name) => argv.some((a) => {
  const m = a.match(/^--?([A-Za-z0-9_-]+)(?:=(.*))?$/);
  return m && m[1].replace(/-/g, '_') === name && m[2] !== 'false';
});

// Every container that runs an onebit role: {obj, pod, labels, container, role, argv, where}.
const containers = [];
for (const obj of docs) {
  const p = podSpecOf(obj);
  if (!p) continue;
  for (const c of [...(p.spec.initContainers || []), ...(p.spec.containers || [])]) {
    const cmd = (c.command || []).map(String);
    const role = cmd.length ? path.posix.basename(cmd[0]) : '';
    if (!ROLES.includes(role)) continue;
    containers.push({obj, pod: p.spec, labels: p.labels, container: c, role,
                     argv: [...cmd.slice(1), ...(c.args || []).map(String)],
                     where: `${nameOf(obj)} ${c.name}`});
  }
}
for (const role of ROLES) {
  if (!containers.some((c) => c.role === role)) problems.push(`no container runs ${role}`);
}

// --- The job secret -------------------------------------------------------
const OCTAL = (mode) => `0${mode.toString(8)}`;
let secretName = null;
let secretWhere = '';
const secretKeys = new Set();
for (const c of containers) {
  if (hasFlag(c.argv, 'insecure')) {
    problems.push(`${c.where}: runs --insecure: anyone who reaches the job may join it`);
  }
  const env = (c.container.env || []).find((e) => e.name === 'ONEBIT_SECRET_FILE');
  const flag = flagValue(c.argv, 'secret_file');
  const file = flag !== undefined ? flag : env && env.value;
  if (!file) {
    problems.push(`${c.where}: no ONEBIT_SECRET_FILE in its env (nor --secret_file): it gets no job secret (deploy/README.md)`);
    continue;
  }
  const shown = flag !== undefined ? `--secret_file=${file}` : `ONEBIT_SECRET_FILE=${file}`;
  // The deepest mount holding the file.
  let vm = null;
  for (const m of c.container.volumeMounts || []) {
    const p = path.posix.normalize(m.mountPath).replace(/(.)\/$/, '$1');
    if (file.startsWith(p === '/' ? '/' : `${p}/`) && (!vm || p.length > vm.p.length)) vm = {m, p};
  }
  const vol = vm && (c.pod.volumes || []).find((v) => v.name === vm.m.name);
  if (!vol || !vol.secret) {
    problems.push(`${c.where}: ${shown} is not a file of a mounted Secret volume`);
    continue;
  }
  if (!vm.m.readOnly) problems.push(`${c.where}: mounts the Secret ${vol.secret.secretName} at ${vm.p} without readOnly: true`);
  if (vm.m.subPath) problems.push(`${c.where}: mounts the Secret with a subPath (not updated, and not needed)`);
  if (vol.secret.optional) problems.push(`${c.where}: the Secret volume ${vol.name} is optional: the pod would start without the secret`);
  // The key the file is: an item's path, or the key itself.
  const rel = file.slice(vm.p === '/' ? 1 : vm.p.length + 1);
  let key = rel;
  let mode = vol.secret.defaultMode === undefined ? 0o644 : vol.secret.defaultMode;
  if (vol.secret.items) {
    const item = vol.secret.items.find((i) => i.path === rel);
    if (!item) {
      problems.push(`${c.where}: ${shown}: the Secret volume ${vol.name} has no item at ${rel}`);
      continue;
    }
    key = item.key;
    if (item.mode !== undefined) mode = item.mode;
  }
  secretKeys.add(key);
  if (mode & 0o007) {
    problems.push(`${c.where}: the Secret volume ${vol.name} has mode ${OCTAL(mode)}: every user in the container may read the job secret (use 0400)`);
  }
  if (!(c.pod.securityContext || {}).fsGroup && !(mode & 0o040) && (c.pod.securityContext || {}).runAsUser !== 0) {
    problems.push(`${c.where}: mode ${OCTAL(mode)} without a pod fsGroup: the file is root's alone, and the job's user cannot read it`);
  }
  if (secretName === null) {
    secretName = vol.secret.secretName;
    secretWhere = c.where;
  } else if (vol.secret.secretName !== secretName) {
    problems.push(`${c.where}: mounts the Secret ${vol.secret.secretName}, but ${secretWhere} mounts ${secretName}: a job has one secret`);
  }
}
if (secretName !== null) {
  const committed = docs.find((d) => d.kind === 'Secret' && d.metadata && d.metadata.name === secretName);
  if (committed) {
    problems.push(`Secret/${secretName}: in the manifests: the job secret would be committed and the same in every deployment; create it with deploy/k8s/make-secret`);
  }
  if (generated) {
    const data = {...(generated.data || {}), ...(generated.stringData || {})};
    if (generated.metadata.name !== secretName) {
      problems.push(`${secretWhere}: mounts the Secret ${secretName}, but make-secret creates ${generated.metadata.name}`);
    }
    for (const key of secretKeys) {
      if (!(key in data)) problems.push(`${secretWhere}: reads key ${key} of the Secret ${secretName}, which make-secret does not create`);
    }
  }
}

// --- NetworkPolicy --------------------------------------------------------
// Whether a LabelSelector selects these labels (an empty one selects all).
function selects(sel, labels) {
  if (!isObject(sel)) return false;
  for (const [k, v] of Object.entries(sel.matchLabels || {})) if (labels[k] !== v) return false;
  for (const e of sel.matchExpressions || []) {
    const has = Object.prototype.hasOwnProperty.call(labels, e.key);
    const values = e.values || [];
    if (e.operator === 'In' && !(has && values.includes(labels[e.key]))) return false;
    if (e.operator === 'NotIn' && has && values.includes(labels[e.key])) return false;
    if (e.operator === 'Exists' && !has) return false;
    if (e.operator === 'DoesNotExist' && has) return false;
  }
  return true;
}
const isEmptySelector = (sel) => !Object.keys(sel.matchLabels || {}).length && !(sel.matchExpressions || []).length;
const policies = docs.filter((d) => d.kind === 'NetworkPolicy');
const ingressPolicy = (np) => (np.spec.policyTypes || ['Ingress']).includes('Ingress');
const jobPods = [...new Map(containers.map((c) => [c.obj, c])).values()];

// Does rule port `p` (number or name) admit container port `port` of pod c?
function portAdmits(p, c, port) {
  if (p.protocol && p.protocol !== 'TCP') return false;
  if (p.port === undefined) return true;
  if (typeof p.port === 'number') return p.endPort !== undefined ? p.port <= port && port <= p.endPort : p.port === port;
  for (const k of [...(c.pod.initContainers || []), ...(c.pod.containers || [])]) {
    for (const cp of k.ports || []) if (cp.name === p.port && cp.containerPort === port) return true;
  }
  return false;
}

// The metrics ports (--metrics_port > 0) that the containers of pod `obj` serve.
const metricsPortsOf = (obj) => containers.filter((k) => k.obj === obj)
    .map((k) => Number(flagValue(k.argv, 'metrics_port'))).filter((p) => p > 0);
// Does every port of `rule` admit a metrics port of pod c, and nothing else
// (no port left open, no range)?
const metricsOnlyRule = (rule, c) => (rule.ports || []).length > 0 &&
    rule.ports.every((p) => p.port !== undefined && p.endPort === undefined &&
                            metricsPortsOf(c.obj).some((mp) => portAdmits(p, c, mp)));
// A peer naming a scraper's pods: a non-empty namespaceSelector and a
// non-empty podSelector, no ipBlock.
const isScraperPeer = (peer) => !peer.ipBlock && isObject(peer.namespaceSelector) && isObject(peer.podSelector) &&
    !isEmptySelector(peer.namespaceSelector) && !isEmptySelector(peer.podSelector);

for (const c of jobPods) {
  const where = `${nameOf(c.obj)} ${c.container.name}`;
  const mine = policies.filter((np) => ingressPolicy(np) && selects((np.spec || {}).podSelector, c.labels));
  if (!mine.length) {
    problems.push(`${where}: no NetworkPolicy selects its pods: anyone who reaches the cluster network reaches them`);
    continue;
  }
  for (const np of mine) {
    (np.spec.ingress || []).forEach((rule, i) => {
      const at = `NetworkPolicy/${np.metadata.name}: ingress[${i}]`;
      if (!rule.from || !rule.from.length) {
        problems.push(`${at}: no "from": admits every source`);
        return;
      }
      if (!rule.ports || !rule.ports.length) problems.push(`${at}: no "ports": admits every port`);
      // A rule for the health port alone may admit the nodes' addresses (the
      // kubelet's probes, where the CNI filters them), not the world.
      const healthOnly = (rule.ports || []).length > 0 &&
          rule.ports.every((p) => portAdmits(p, c, Number(flagValue(c.argv, 'health_port') || -1)) ||
                                  p.port === 'health');
      // A rule for the metrics port alone may admit a scraper's pods in
      // another namespace (both selectors, neither empty), nothing wider.
      const metricsOnly = metricsOnlyRule(rule, c);
      const metricsToo = !metricsOnly && metricsPortsOf(c.obj).length > 0 &&
          (!rule.ports || !rule.ports.length ||
           rule.ports.some((p) => metricsPortsOf(c.obj).some((mp) => portAdmits(p, c, mp))));
      for (const peer of rule.from) {
        if (peer.ipBlock && healthOnly && !['0.0.0.0/0', '::/0'].includes(peer.ipBlock.cidr)) continue;
        if (metricsOnly && (peer.ipBlock || peer.namespaceSelector)) {
          if (isScraperPeer(peer)) continue;
          const why = peer.ipBlock ? `ipBlock ${peer.ipBlock.cidr}` :
              isEmptySelector(peer.namespaceSelector) ? 'every namespace (an empty namespaceSelector)' :
                `every pod of the namespaces ${JSON.stringify(peer.namespaceSelector)} (no podSelector)`;
          problems.push(`${at}: admits ${why} to the metrics port: only the scraper's pods may ` +
                        '(a namespaceSelector and a podSelector naming them)');
          continue;
        }
        if (metricsToo && peer.namespaceSelector && !peer.ipBlock) {
          problems.push(`${at}: admits other namespaces on a port other than the metrics port ` +
                        `(${(rule.ports || []).map((p) => p.port).join(', ') || 'every port'}): ` +
                        'a scraper may reach the metrics port alone');
          continue;
        }
        if (peer.ipBlock || peer.namespaceSelector || !peer.podSelector) {
          problems.push(`${at}: admits ${peer.ipBlock ? `ipBlock ${peer.ipBlock.cidr}` : 'other namespaces'}, not only the job's pods`);
        } else if (isEmptySelector(peer.podSelector)) {
          problems.push(`${at}: an empty podSelector admits every pod of the namespace, not only the job's`);
        } else if (!jobPods.some((j) => selects(peer.podSelector, j.labels))) {
          problems.push(`${at}: podSelector ${JSON.stringify(peer.podSelector)} selects none of the job's pods`);
        }
      }
    });
  }
}

// What the job itself needs admitted, container by container (a pod may
// run a server beside its worker): [port flag, default, client roles].
for (const c of containers) {
  const where = c.where;
  const mine = policies.filter((np) => ingressPolicy(np) && selects((np.spec || {}).podSelector, c.labels));
  if (!mine.length) continue;  // reported above
  const needs = {
    'onebit-coordinator': ['port', 7070, ['onebit-server', 'onebit-worker']],
    'onebit-server': ['data_port', 5555, ['onebit-worker']],
  }[c.role];
  if (!needs) continue;
  const [flag, dflt, clients] = needs;
  const port = Number(flagValue(c.argv, flag) || dflt);
  for (const client of clients) {
    const from = jobPods.filter((j) => containers.some((k) => k.obj === j.obj && k.role === client));
    for (const f of from) {
      const ok = mine.some((np) => (np.spec.ingress || []).some((rule) =>
        (!(rule.from || []).length ||  // every source: reported above
         rule.from.some((peer) => peer.podSelector && selects(peer.podSelector, f.labels))) &&
        (!rule.ports || rule.ports.some((p) => portAdmits(p, c, port)))));
      if (!ok) {
        problems.push(`${where}: no NetworkPolicy admits ${client} (${nameOf(f.obj)}) to its --${flag} ${port}: the job could not run`);
      }
    }
  }
}

// A coordinator that serves metrics is scraped: some rule admits a
// scraper's pods (as above) to its --metrics_port.
for (const c of containers) {
  const port = Number(flagValue(c.argv, 'metrics_port'));
  if (!(port > 0)) continue;
  const mine = policies.filter((np) => ingressPolicy(np) && selects((np.spec || {}).podSelector, c.labels));
  if (!mine.length) continue;  // reported above
  const ok = mine.some((np) => (np.spec.ingress || []).some((rule) =>
    metricsOnlyRule(rule, c) && (rule.from || []).some(isScraperPeer) &&
    rule.ports.some((p) => portAdmits(p, c, port))));
  if (!ok) {
    problems.push(`${c.where}: no NetworkPolicy admits a scraper (a namespaceSelector and a podSelector ` +
                  `naming the Prometheus pods) to its --metrics_port ${port}: Prometheus could not scrape it`);
  }
}

// --- Scraping: the names that point at the metrics port agree with it --------
// The container port named metrics (the NetworkPolicy's and the PodMonitor's
// name for it), the pod's prometheus.io/port annotation, and every
// PodMonitor's endpoint port.
const annotationsOf = (obj) => (obj.kind === 'Pod' ? obj.metadata : ((obj.spec || {}).template || {}).metadata) || {};
for (const c of containers) {
  const port = Number(flagValue(c.argv, 'metrics_port'));
  if (!(port > 0)) continue;
  const named = (c.container.ports || []).find((p) => p.name === 'metrics');
  if (!named || named.containerPort !== port) {
    problems.push(`${c.where}: --metrics_port ${port} is not its container port named metrics ` +
                  `(${named ? named.containerPort : 'none'}): the NetworkPolicy and the PodMonitor name that port`);
  }
  const ann = annotationsOf(c.obj).annotations || {};
  if (ann['prometheus.io/port'] !== undefined && Number(ann['prometheus.io/port']) !== port) {
    problems.push(`${c.where}: annotation prometheus.io/port is ${ann['prometheus.io/port']}, ` +
                  `but --metrics_port is ${port}: Prometheus would scrape the wrong port`);
  }
}
for (const pm of docs.filter((d) => d.kind === 'PodMonitor')) {
  const sel = (pm.spec || {}).selector;
  const pods = jobPods.filter((j) => sel && selects(sel, j.labels));
  if (!pods.length) {
    problems.push(`PodMonitor/${pm.metadata.name}: its selector selects none of the job's pods`);
    continue;
  }
  ((pm.spec || {}).podMetricsEndpoints || []).forEach((ep, i) => {
    for (const j of pods) {
      const ports = [...(j.pod.initContainers || []), ...(j.pod.containers || [])].flatMap((k) => k.ports || []);
      const port = ports.find((p) => p.name === ep.port);
      if (!port || !metricsPortsOf(j.obj).includes(port.containerPort)) {
        problems.push(`PodMonitor/${pm.metadata.name}: podMetricsEndpoints[${i}]: port ${ep.port} is not a ` +
                      `--metrics_port of ${nameOf(j.obj)}'s containers`);
      }
    }
  });
}

// --- Egress: default deny, the job's own connections and DNS ---------------
const egressPolicy = (np) => (np.spec.policyTypes || (np.spec.egress ? ['Ingress', 'Egress'] : ['Ingress']))
    .includes('Egress');
// The cluster's DNS pods: kube-system's k8s-app=kube-dns, on port 53 alone.
const isDnsRule = (rule) => (rule.ports || []).length > 0 &&
    rule.ports.every((p) => p.port === 53 || p.port === 'dns' || p.port === 'dns-tcp') &&
    (rule.to || []).every((peer) => peer.namespaceSelector && peer.podSelector && !peer.ipBlock &&
        ((peer.namespaceSelector.matchLabels || {})['kubernetes.io/metadata.name'] === 'kube-system') &&
        !isEmptySelector(peer.podSelector));
for (const c of jobPods) {
  const where = `${nameOf(c.obj)} ${c.container.name}`;
  const mine = policies.filter((np) => egressPolicy(np) && selects((np.spec || {}).podSelector, c.labels));
  if (!mine.length) {
    problems.push(`${where}: no NetworkPolicy restricts its egress: it may connect anywhere, the internet included`);
    continue;
  }
  for (const np of mine) {
    (np.spec.egress || []).forEach((rule, i) => {
      const at = `NetworkPolicy/${np.metadata.name}: egress[${i}]`;
      if (!rule.to || !rule.to.length) {
        problems.push(`${at}: no "to": admits every destination`);
        return;
      }
      if (!rule.ports || !rule.ports.length) problems.push(`${at}: no "ports": admits every port`);
      if (isDnsRule(rule)) return;
      for (const peer of rule.to) {
        if (peer.ipBlock || peer.namespaceSelector || !peer.podSelector) {
          problems.push(`${at}: admits ${peer.ipBlock ? `ipBlock ${peer.ipBlock.cidr}` : 'other namespaces'}, ` +
                        'not only the job\'s pods and the cluster\'s DNS');
        } else if (isEmptySelector(peer.podSelector)) {
          problems.push(`${at}: an empty podSelector admits every pod of the namespace, not only the job's`);
        } else if (!jobPods.some((j) => selects(peer.podSelector, j.labels))) {
          problems.push(`${at}: podSelector ${JSON.stringify(peer.podSelector)} selects none of the job's pods`);
        }
      }
    });
  }
  if (!mine.some((np) => (np.spec.egress || []).some(isDnsRule))) {
    problems.push(`${where}: no NetworkPolicy admits DNS (kube-system's kube-dns, port 53) from its pods: ` +
                  'it could not resolve the job\'s names');
  }
}
// What the job itself connects to, container by container: [client role,
// server role, port flag of the server, default].
for (const [client, target, flag, dflt] of [
  ['onebit-server', 'onebit-coordinator', 'port', 7070],
  ['onebit-worker', 'onebit-coordinator', 'port', 7070],
  ['onebit-worker', 'onebit-server', 'data_port', 5555],
  ['onebit-coordinator', 'onebit-server', 'health_port', 8081],
  ['onebit-coordinator', 'onebit-worker', 'health_port', 8081],
]) {
  for (const from of containers.filter((k) => k.role === client)) {
    const mine = policies.filter((np) => egressPolicy(np) && selects((np.spec || {}).podSelector, from.labels));
    if (!mine.length) continue;  // reported above
    for (const to of containers.filter((k) => k.role === target)) {
      const port = Number(flagValue(to.argv, flag) || dflt);
      const ok = mine.some((np) => (np.spec.egress || []).some((rule) =>
        (rule.to || []).some((peer) => peer.podSelector && !peer.namespaceSelector && selects(peer.podSelector, to.labels)) &&
        (!rule.ports || rule.ports.some((p) => portAdmits(p, to, port)))));
      if (!ok) {
        problems.push(`${from.where}: no NetworkPolicy admits its egress to ${target} (${to.where}) ` +
                      `--${flag} ${port}: the job could not run`);
      }
    }
  }
}

// --- Nothing bound wider than the pod network ------------------------------
for (const c of jobPods) {
  if (c.pod.hostNetwork) problems.push(`${nameOf(c.obj)}: hostNetwork: its ports would listen on the node's addresses`);
  for (const k of [...(c.pod.initContainers || []), ...(c.pod.containers || [])]) {
    for (const p of k.ports || []) {
      if (p.hostPort) problems.push(`${nameOf(c.obj)} ${k.name}: hostPort ${p.hostPort}: reachable on the node's address, past the NetworkPolicy`);
    }
  }
}
for (const s of docs.filter((d) => d.kind === 'Service')) {
  const type = (s.spec || {}).type || 'ClusterIP';
  if (type !== 'ClusterIP') problems.push(`Service/${s.metadata.name}: type ${type}: reachable from outside the cluster`);
  if (((s.spec || {}).externalIPs || []).length) problems.push(`Service/${s.metadata.name}: externalIPs: reachable from outside the cluster`);
}

for (const p of problems) process.stdout.write(`${p}\n`);
if (problems.length) {
  process.stdout.write(`secure: ${problems.length} problem(s)\n`);
  process.exit(1);
}
process.stdout.write(`secure: ${containers.length} containers read the job secret from Secret ${secretName}; ` +
                     `${policies.length} NetworkPolicies admit only the job's pods, in and out ` +
                     '(and a scraper to the metrics port)\n');
