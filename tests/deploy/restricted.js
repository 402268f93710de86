#!/usr/bin/env node
// Pod Security of rendered manifests (tests/deploy/check.sh restricted OVERLAY):
//   kubectl kustomize deploy/k8s/overlays/gpu | node tests/deploy/restricted.js [-]
// Asserts that every pod template passes the Pod Security Standard
// "restricted" (the namespace label pod-security.kubernetes.io/enforce:
// restricted admits it), and more:
// - the restricted profile: no hostNetwork/hostPID/hostIPC, no hostPath or
//   other non-restricted volume types, no privileged container, no hostPort,
//   runAsNonRoot (pod or container) and no runAsUser 0, seccompProfile
//   RuntimeDefault or Localhost (pod or container), allowPrivilegeEscalation
//   false and capabilities dropping ALL (adding NET_BIND_SERVICE at most) in
//   every container;
// - beyond it: every container's root filesystem is read-only
//   (readOnlyRootFilesystem: true) with a writable emptyDir at /tmp, and a
//   pod with an fsGroup sets fsGroupChangePolicy: OnRootMismatch (no
//   recursive chown of a claim holding GB of checkpoints at every start).
// Exit 0: all fine; 1: a problem, printed as "<Kind>/<name> <container>:
// <what>"; 2: usage or input errors.
'use strict';

const {start, readDocuments, isObject} = require('../../tools/k8s-common');

const die = start('restricted');
const files = process.argv.slice(2);
if (files.length === 0) files.push('-');
const docs = readDocuments(files, die).map((d) => d.doc).filter(isObject);

const problems = [];
const nameOf = (obj) => `${obj.kind}/${obj.metadata && obj.metadata.name}`;
// Volume types the restricted profile allows.
const VOLUMES = ['configMap', 'csi', 'downwardAPI', 'emptyDir', 'ephemeral', 'persistentVolumeClaim',
                 'projected', 'secret'];

function podSpecOf(obj) {
  const s = obj.spec || {};
  if (obj.kind === 'Pod') return s;
  if (obj.kind === 'CronJob') return s.jobTemplate && s.jobTemplate.spec && s.jobTemplate.spec.template &&
      s.jobTemplate.spec.template.spec;
  return s.template && s.template.spec;
}

let pods = 0;
for (const obj of docs) {
  const pod = podSpecOf(obj);
  if (!pod) continue;
  pods++;
  const at = nameOf(obj);
  const psc = pod.securityContext || {};
  for (const f of ['hostNetwork', 'hostPID', 'hostIPC']) {
    if (pod[f]) problems.push(`${at}: ${f}: not allowed by Pod Security "restricted"`);
  }
  for (const v of pod.volumes || []) {
    const type = Object.keys(v).find((k) => k !== 'name');
    if (!VOLUMES.includes(type)) problems.push(`${at}: volume ${v.name} is a ${type}: not allowed by Pod Security "restricted"`);
  }
  if (psc.fsGroup !== undefined && psc.fsGroupChangePolicy !== 'OnRootMismatch') {
    problems.push(`${at}: securityContext.fsGroupChangePolicy is ${psc.fsGroupChangePolicy}, not OnRootMismatch: ` +
                  `every start would chown each file of its claims`);
  }
  const tmpVolumes = new Set((pod.volumes || []).filter((v) => v.emptyDir).map((v) => v.name));
  for (const c of [...(pod.initContainers || []), ...(pod.containers || [])]) {
    const where = `${at} ${c.name}`;
    const sc = c.securityContext || {};
    const pick = (f) => (sc[f] !== undefined ? sc[f] : psc[f]);
    if (sc.privileged) problems.push(`${where}: privileged: not allowed by Pod Security "restricted"`);
    for (const p of c.ports || []) {
      if (p.hostPort) problems.push(`${where}: hostPort ${p.hostPort}: not allowed by Pod Security "restricted"`);
    }
    if (pick('runAsNonRoot') !== true) {
      problems.push(`${where}: runAsNonRoot is not true (pod or container securityContext): ` +
                    `Pod Security "restricted" requires it`);
    }
    if (pick('runAsUser') === 0) problems.push(`${where}: runAsUser 0: Pod Security "restricted" forbids root`);
    const seccomp = (sc.seccompProfile || psc.seccompProfile || {}).type;
    if (!['RuntimeDefault', 'Localhost'].includes(seccomp)) {
      problems.push(`${where}: seccompProfile is ${seccomp}, not RuntimeDefault: Pod Security "restricted" requires it`);
    }
    if (sc.allowPrivilegeEscalation !== false) {
      problems.push(`${where}: allowPrivilegeEscalation is not false: Pod Security "restricted" requires it`);
    }
    const caps = sc.capabilities || {};
    if (!(caps.drop || []).includes('ALL')) {
      problems.push(`${where}: capabilities.drop lacks ALL: Pod Security "restricted" requires it`);
    }
    for (const a of caps.add || []) {
      if (a !== 'NET_BIND_SERVICE') problems.push(`${where}: capabilities.add ${a}: Pod Security "restricted" allows NET_BIND_SERVICE only`);
    }
    if (sc.readOnlyRootFilesystem !== true) {
      problems.push(`${where}: readOnlyRootFilesystem is not true: the image's files could be changed at run time`);
    }
    const tmp = (c.volumeMounts || []).find((m) => m.mountPath.replace(/\/$/, '') === '/tmp');
    if (!tmp || !tmpVolumes.has(tmp.name) || tmp.readOnly) {
      problems.push(`${where}: no writable emptyDir at /tmp: with a read-only root filesystem it has no scratch space`);
    }
  }
}

if (pods === 0) die('no pod templates in the manifests');
for (const p of problems) process.stdout.write(`${p}\n`);
if (problems.length) {
  process.stdout.write(`restricted: ${problems.length} problem(s)\n`);
  process.exit(1);
}
process.stdout.write(`restricted: ${pods} pod templates pass Pod Security "restricted", read-only roots with /tmp\n`);
