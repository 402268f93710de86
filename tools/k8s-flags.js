#!/usr/bin/env node
// Flag drift check: every flag that a rendered manifest passes to an onebit
// binary exists in that binary, so manifests cannot drift from the code.
//   kubectl kustomize deploy/k8s/overlays/gpu |
//     node tools/k8s-flags.js --bin-dir build [--dockerfile deploy/docker/Dockerfile] [-]
// The flags of a binary are read from `<bin-dir>/<binary> --helpfull`, the
// binary from each container's command. Also checked: the keys of a JSON
// training config passed with --config (from a mounted ConfigMap) are flags of
// that binary; the coordinator's workers/servers (its --workers/--servers,
// expanded from env and ConfigMaps, else its config's) equal the worker
// Job's completions/parallelism and the servers' count (a Job's completions,
// a StatefulSet's replicas, or one per pod of a Job whose pods run a server
// each); each binary
// is installed by the Dockerfile. Exit 0: all fine; 1: a problem, printed as
// "<Kind>/<name> <container>: <what>"; 2: usage or input errors.
'use strict';

const fs = require('fs');
const path = require('path');
const {execFileSync} = require('child_process');
const {start, readDocuments, isObject, expandedArgv} = require('./k8s-common');

const die = start('k8s-flags');

const args = process.argv.slice(2);
let binDir = null;
let dockerfile = null;
const files = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === '--bin-dir') binDir = args[++i];
  else if (args[i] === '--dockerfile') dockerfile = args[++i];
  else if (args[i] === '-' || !args[i].startsWith('--')) files.push(args[i]);
  else die(`unknown option ${args[i]}`);
}
if (!binDir) die('usage: k8s-flags.js --bin-dir DIR [--dockerfile FILE] [FILE|-]...');
if (files.length === 0) files.push('-');

// name -> {bool: boolean} from `--helpfull` (absl's listing:
// "    --name (help...); default: value;").
const flagCache = new Map();
function flagsOf(binary) {
  if (flagCache.has(binary)) return flagCache.get(binary);
  const exe = path.join(binDir, binary);
  if (!fs.existsSync(exe)) die(`${exe} not found (build it first)`);
  let out;
  try {
    out = execFileSync(exe, ['--helpfull'], {encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe']});
  } catch (e) {
    out = `${e.stdout || ''}${e.stderr || ''}`;  // absl exits 1 after --helpfull
  }
  const flags = new Map();
  // absl indents a flag's line by 4 spaces and its wrapped help by 6, which
  // may itself begin with "--" (a help text naming another flag).
  const text = out.replace(/\n {6,}/g, ' ');  // join wrapped help lines
  for (const m of text.matchAll(/^ {4}--([A-Za-z0-9_]+) \(.*\); default: ([^;\n]*);$/gm)) {
    flags.set(m[1], {bool: m[2] === 'true' || m[2] === 'false'});
  }
  // Every flag line must have parsed, or this check would miss flags.
  const lines = (out.match(/^ {4}--[A-Za-z0-9_]+ \(/gm) || []).length;
  if (flags.size === 0 || flags.size !== lines) {
    die(`cannot parse ${exe} --helpfull (${flags.size} of ${lines} flag lines):\n${out}`);
  }
  flagCache.set(binary, flags);
  return flags;
}

function podSpecOf(obj) {
  const s = obj.spec || {};
  switch (obj.kind) {
    case 'Pod': return s;
    case 'Deployment': case 'StatefulSet': case 'DaemonSet': case 'ReplicaSet': case 'Job':
      return s.template && s.template.spec;
    case 'CronJob':
      return s.jobTemplate && s.jobTemplate.spec && s.jobTemplate.spec.template &&
          s.jobTemplate.spec.template.spec;
    default: return null;
  }
}

const docs = readDocuments(files, die).map((d) => d.doc).filter(isObject);
if (docs.length === 0) die(`no objects in ${files.join(' ')}`);

const problems = [];
const used = new Map();  // binary -> object names
const configs = [];      // {where, cfg}
const byRole = new Map();  // binary -> [obj]
let containers = 0;

// The JSON config that a mounted ConfigMap provides at `file`, or an error.
function mountedConfig(podSpec, container, file) {
  for (const vm of container.volumeMounts || []) {
    const dir = vm.mountPath.replace(/\/$/, '');
    if (path.posix.dirname(file) !== dir) continue;
    const vol = (podSpec.volumes || []).find((v) => v.name === vm.name);
    if (!vol || !vol.configMap) continue;
    const cm = docs.find((d) => d.kind === 'ConfigMap' && d.metadata.name === vol.configMap.name);
    if (!cm) return {error: `ConfigMap ${vol.configMap.name} is not in the manifests`};
    const key = path.posix.basename(file);
    if (!cm.data || !(key in cm.data)) return {error: `ConfigMap ${cm.metadata.name} has no key ${key}`};
    try {
      return {cfg: JSON.parse(cm.data[key]), from: `ConfigMap/${cm.metadata.name} ${key}`};
    } catch (e) {
      return {error: `ConfigMap/${cm.metadata.name} ${key} is not JSON: ${e.message}`};
    }
  }
  return {error: 'not a file of a mounted ConfigMap'};
}

for (const obj of docs) {
  const podSpec = podSpecOf(obj);
  if (!podSpec) continue;
  const objName = `${obj.kind}/${obj.metadata && obj.metadata.name}`;
  for (const c of [...(podSpec.initContainers || []), ...(podSpec.containers || [])]) {
    const where = `${objName} ${c.name}`;
    const cmd = c.command || [];
    const binary = cmd.length ? path.posix.basename(String(cmd[0])) : null;
    if (!binary || !binary.startsWith('onebit-')) {
      if (/onebit-ps/.test(String(c.image || ''))) {
        problems.push(`${where}: runs the onebit-ps image without an onebit-* command (name the binary so its flags can be checked)`);
      }
      continue;
    }
    containers++;
    if (!used.has(binary)) used.set(binary, []);
    used.get(binary).push(where);
    if (!byRole.has(binary)) byRole.set(binary, []);
    byRole.get(binary).push(obj);
    const flags = flagsOf(binary);
    const argv = [...cmd.slice(1), ...(c.args || [])].map(String);
    for (let i = 0; i < argv.length; i++) {
      const a = argv[i];
      if (!a.startsWith('-') || a === '-' || a === '--') {
        problems.push(`${where}: '${a}': not a flag (${binary} takes no positional arguments)`);
        continue;
      }
      const eq = a.indexOf('=');
      const name = a.slice(a.startsWith('--') ? 2 : 1, eq < 0 ? undefined : eq).replace(/-/g, '_');
      let flag = flags.get(name);
      if (!flag && name.startsWith('no') && eq < 0 && flags.has(name.slice(2)) &&
          flags.get(name.slice(2)).bool) {
        flag = flags.get(name.slice(2));
      }
      if (!flag) {
        problems.push(`${where}: --${name}: unknown flag of ${binary} (see ${binary} --helpfull)`);
        continue;
      }
      const value = eq >= 0 ? a.slice(eq + 1) : (flag.bool ? null : argv[++i]);
      if (name === 'config' && value) {
        const r = mountedConfig(podSpec, c, value);
        if (r.error) {
          problems.push(`${where}: --config=${value}: ${r.error}`);
        } else if (typeof r.cfg !== 'object' || r.cfg === null || Array.isArray(r.cfg)) {
          problems.push(`${where}: ${r.from}: not a JSON object`);
        } else {
          for (const key of Object.keys(r.cfg)) {
            if (!flags.has(key.replace(/-/g, '_'))) {
              problems.push(`${where}: ${r.from}: key "${key}" is not a flag of ${binary} (see ${binary} --helpfull)`);
            }
          }
          configs.push({where, from: r.from, cfg: r.cfg, argv: expandedArgv(c, docs)});
        }
      }
    }
  }
}

// The config's cluster size must match the workloads that provide it.
// A count given on the command line (expanded from env and ConfigMaps as the
// kubelet does: deploy/k8s sets it from the ConfigMap onebit-size) wins over
// the config's, as in the binaries.
function countOf(argv, cfg, key, from, where) {
  for (const a of argv) {
    const m = a.match(/^--?([A-Za-z0-9_-]+)=(.*)$/);
    if (m && m[1].replace(/-/g, '_') === key) return {n: Number(m[2]), from: `${where} --${key}=${m[2]}`};
  }
  return {n: cfg[key] === undefined ? 1 : cfg[key], from: `${from} says ${key}=${cfg[key] === undefined ? 1 : cfg[key]}`};
}
for (const {where, from, cfg, argv} of configs) {
  const w = countOf(argv, cfg, 'workers', from, where);
  const s = countOf(argv, cfg, 'servers', from, where);
  const workers = w.n;
  const servers = s.n;
  for (const obj of byRole.get('onebit-worker') || []) {
    for (const field of ['completions', 'parallelism']) {
      const v = obj.kind === 'Job' ? obj.spec[field] : undefined;
      if (v !== workers) {
        problems.push(`${obj.kind}/${obj.metadata.name}: spec.${field} is ${v}, but ${w.from}`);
      }
    }
  }
  // Servers: a StatefulSet's replicas, or one per pod of a Job that runs
  // them beside its workers (deploy/k8s/overlays/colocated).
  const serverObjs = byRole.get('onebit-server') || [];
  let total = 0;
  const counts = [];
  for (const obj of serverObjs) {
    const field = obj.kind === 'Job' ? 'completions' : 'replicas';
    const v = obj.spec[field] === undefined ? 1 : obj.spec[field];
    total += v;
    counts.push(`${obj.kind}/${obj.metadata.name}: spec.${field} is ${v}`);
  }
  if (serverObjs.length && total !== servers) {
    problems.push(`${counts.join(', ')}, but ${s.from}`);
  }
}

if (dockerfile) {
  // Instructions only: a binary named in a comment is not installed.
  const text = fs.readFileSync(dockerfile, 'utf8').split('\n')
      .filter((l) => !/^\s*#/.test(l)).join('\n');
  for (const [binary, wheres] of used) {
    if (!new RegExp(`\\b${binary}\\b`).test(text)) {
      problems.push(`${wheres[0]}: ${binary} is not installed by ${dockerfile}`);
    }
  }
}

if (containers === 0) die('no container runs an onebit-* binary');
for (const p of problems) process.stdout.write(`${p}\n`);
if (problems.length) {
  process.stdout.write(`k8s-flags: ${problems.length} problem(s)\n`);
  process.exit(1);
}
process.stdout.write(`k8s-flags: ${containers} containers, every flag known to ${[...used.keys()].join(', ')}` +
                     `${configs.length ? `; ${configs.length} config(s) match` : ''}\n`);
