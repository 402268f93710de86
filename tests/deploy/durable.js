#!/usr/bin/env node
// Checkpoint and restart wiring of rendered manifests (tests/deploy/check.sh
// durable OVERLAY):
//   kubectl kustomize deploy/k8s/overlays/gpu | node tests/deploy/durable.js [-]
// Asserts what a job needs to survive preemption and the loss of a process:
// - the coordinator runs in a Job with restartPolicy OnFailure and
//   backoffLimit > 0 (a finished job is not restarted, a failed one is);
// - the servers run in a StatefulSet (restarted whenever they exit), or
//   beside the workers in their Indexed Job's pods (restartPolicy OnFailure);
// - the workers run in an Indexed Job with backoffLimit (or
//   backoffLimitPerIndex) > 0;
// - the coordinator's training config (--config, from a mounted ConfigMap,
//   or --checkpoint_dir) names a checkpoint_dir, and checkpoint_every > 0;
// - the coordinator, every server and every worker mount one and the same
//   persistentVolumeClaim (the same claim, subPath and mountPath) at that
//   folder or above it, not read-only, and the claim is in the manifests
//   with ReadWriteMany (a StatefulSet's volumeClaimTemplates would give each
//   server a claim of its own).
// A missing backoffLimit counts as Kubernetes' default, 6. Exit 0: all fine;
// 1: a problem, printed as "<Kind>/<name> <container>: <what>"; 2: usage or
// input errors.
'use strict';

const path = require('path');
const {start, readDocuments, isObject} = require('../../tools/k8s-common');

const die = start('durable');
const files = process.argv.slice(2);
if (files.length === 0) files.push('-');
const docs = readDocuments(files, die).map((d) => d.doc).filter(isObject);

const problems = [];
const nameOf = (obj) => `${obj.kind}/${obj.metadata && obj.metadata.name}`;

// [{obj, podSpec, container, argv}] for every container that runs `binary`.
function containersOf(binary) {
  const out = [];
  for (const obj of docs) {
    const s = obj.spec || {};
    const podSpec = obj.kind === 'Pod' ? s : s.template && s.template.spec;
    if (!podSpec) continue;
    for (const c of [...(podSpec.initContainers || []), ...(podSpec.containers || [])]) {
      const cmd = (c.command || []).map(String);
      if (!cmd.length || path.posix.basename(cmd[0]) !== binary) continue;
      out.push({obj, podSpec, container: c, argv: [...cmd.slice(1), ...(c.args || []).map(String)]});
    }
  }
  if (out.length === 0) problems.push(`no container runs ${binary}`);
  return out;
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

// A config key in underscore or dash spelling, or undefined.
function setting(cfg, name) {
  return cfg[name] !== undefined ? cfg[name] : cfg[name.replace(/_/g, '-')];
}

// The JSON config the coordinator reads with --config (a file of a mounted
// ConfigMap), or {} with a problem noted.
function coordinatorConfig({podSpec, container, argv}, where) {
  const file = flagValue(argv, 'config');
  if (!file) return {};
  for (const vm of container.volumeMounts || []) {
    if (path.posix.dirname(file) !== vm.mountPath.replace(/\/$/, '')) continue;
    const vol = (podSpec.volumes || []).find((v) => v.name === vm.name);
    if (!vol || !vol.configMap) continue;
    const cm = docs.find((d) => d.kind === 'ConfigMap' && d.metadata.name === vol.configMap.name);
    const text = cm && cm.data && cm.data[path.posix.basename(file)];
    if (text === undefined) break;
    try {
      return JSON.parse(text);
    } catch (e) {
      problems.push(`${where}: --config=${file}: not JSON: ${e.message}`);
      return {};
    }
  }
  problems.push(`${where}: --config=${file}: not a file of a mounted ConfigMap in the manifests`);
  return {};
}

// The first of `fields` that is set (backoffLimit: 6 where none is) must be > 0.
function checkBackoff(obj, where, fields) {
  const field = fields.find((f) => obj.spec[f] !== undefined) || 'backoffLimit';
  const limit = obj.spec[field] === undefined ? 6 : obj.spec[field];
  if (!(Number.isInteger(limit) && limit > 0)) {
    problems.push(`${where}: spec.${field} is ${limit}: a failed job would not be restarted (needs > 0)`);
  }
}

// Coordinator: a Job that restarts on failure only.
const coordinators = containersOf('onebit-coordinator');
if (coordinators.length > 1) problems.push(`${coordinators.length} coordinator containers: a job has one`);
let checkpointDir;
let coordinatorWhere = '';
for (const c of coordinators) {
  const where = coordinatorWhere = `${nameOf(c.obj)} ${c.container.name}`;
  if (c.obj.kind !== 'Job') {
    problems.push(`${where}: the coordinator runs in a ${c.obj.kind}, not a Job (a finished job must not be started again)`);
  } else {
    checkBackoff(c.obj, where, ['backoffLimit']);
  }
  if (c.podSpec.restartPolicy !== 'OnFailure') {
    problems.push(`${where}: restartPolicy is ${c.podSpec.restartPolicy}, not OnFailure`);
  }
  const cfg = coordinatorConfig(c, where);
  const flag = flagValue(c.argv, 'checkpoint_dir');
  const fromCfg = setting(cfg, 'checkpoint_dir');
  if (flag !== undefined && fromCfg !== undefined && flag !== fromCfg) {
    problems.push(`${where}: --checkpoint_dir=${flag} but the config says "checkpoint_dir": "${fromCfg}"`);
  }
  checkpointDir = flag !== undefined ? flag : fromCfg;
  if (!checkpointDir) problems.push(`${where}: no checkpoint_dir in its config or flags`);
  const flagEvery = flagValue(c.argv, 'checkpoint_every');
  const every = flagEvery !== undefined ? flagEvery : setting(cfg, 'checkpoint_every');
  if (!(Number(every) > 0)) problems.push(`${where}: checkpoint_every is ${every}: the job never checkpoints`);
}

// Servers: a StatefulSet (restarts them whenever they exit), or beside the
// workers in their Indexed Job's pods (restarted with them; checked below).
const servers = containersOf('onebit-server');
const runsWorkers = (obj) => ((obj.spec.template && obj.spec.template.spec.containers) || [])
    .some((k) => (k.command || []).length && path.posix.basename(String(k.command[0])) === 'onebit-worker');
for (const c of servers) {
  const where = `${nameOf(c.obj)} ${c.container.name}`;
  if (c.obj.kind === 'Job' && c.obj.spec.completionMode === 'Indexed' && runsWorkers(c.obj)) {
    if (c.podSpec.restartPolicy !== 'OnFailure') {
      problems.push(`${where}: a server beside the workers with restartPolicy ${c.podSpec.restartPolicy}, not OnFailure`);
    }
  } else if (c.obj.kind !== 'StatefulSet') {
    problems.push(`${where}: the servers run in a ${c.obj.kind}, not a StatefulSet (nor beside the workers in their Indexed Job)`);
  }
}

// Workers: an Indexed Job that restarts failed ranks.
const workers = containersOf('onebit-worker');
for (const c of workers) {
  const where = `${nameOf(c.obj)} ${c.container.name}`;
  if (c.obj.kind !== 'Job' || c.obj.spec.completionMode !== 'Indexed') {
    problems.push(`${where}: the workers run in a ${c.obj.kind}, not an Indexed Job`);
  } else {
    checkBackoff(c.obj, where, ['backoffLimitPerIndex', 'backoffLimit']);
  }
}

// One claim, mounted alike by every process at or above checkpoint_dir.
if (checkpointDir) {
  const dir = path.posix.normalize(checkpointDir).replace(/(.)\/$/, '$1');
  let first = null;
  for (const c of [...coordinators, ...servers, ...workers]) {
    const where = `${nameOf(c.obj)} ${c.container.name}`;
    // The deepest mount at or above dir holds it.
    let vm = null;
    for (const m of c.container.volumeMounts || []) {
      const p = path.posix.normalize(m.mountPath).replace(/(.)\/$/, '$1');
      if ((dir === p || dir.startsWith(p === '/' ? '/' : `${p}/`)) && (!vm || p.length > vm.p.length)) vm = {m, p};
    }
    if (!vm) {
      problems.push(`${where}: mounts nothing at ${checkpointDir} (the checkpoint_dir of ${coordinatorWhere})`);
      continue;
    }
    if (vm.m.readOnly) problems.push(`${where}: mounts ${vm.p} read-only`);
    const vct = c.obj.kind === 'StatefulSet' &&
        (c.obj.spec.volumeClaimTemplates || []).some((t) => t.metadata && t.metadata.name === vm.m.name);
    const vol = (c.podSpec.volumes || []).find((v) => v.name === vm.m.name);
    if (vct || !vol || !vol.persistentVolumeClaim) {
      problems.push(`${where}: volume ${vm.m.name} at ${vm.p} is ${vct ? 'a volumeClaimTemplate (a claim per pod)' : 'not a persistentVolumeClaim'}, not the job's shared claim`);
      continue;
    }
    const mount = {claim: vol.persistentVolumeClaim.claimName, mountPath: vm.p, subPath: vm.m.subPath || ''};
    const text = `claim ${mount.claim} at ${mount.mountPath}${mount.subPath ? ` (subPath ${mount.subPath})` : ''}`;
    if (!first) {
      first = {mount, text, where};
      const pvc = docs.find((d) => d.kind === 'PersistentVolumeClaim' && d.metadata.name === mount.claim);
      if (!pvc) {
        problems.push(`${where}: PersistentVolumeClaim ${mount.claim} is not in the manifests`);
      } else if (!((pvc.spec && pvc.spec.accessModes) || []).includes('ReadWriteMany')) {
        problems.push(`PersistentVolumeClaim/${mount.claim}: accessModes ${JSON.stringify((pvc.spec || {}).accessModes)} lack ReadWriteMany (every process writes there)`);
      }
    } else if (JSON.stringify(mount) !== JSON.stringify(first.mount)) {
      problems.push(`${where}: mounts ${text}, but ${first.where} mounts ${first.text}`);
    }
  }
}

for (const p of problems) process.stdout.write(`${p}\n`);
if (problems.length) {
  process.stdout.write(`durable: ${problems.length} problem(s)\n`);
  process.exit(1);
}
process.stdout.write(`durable: coordinator, server and worker containers restart on failure and share ` +
                     `the checkpoints at ${checkpointDir}\n`);
