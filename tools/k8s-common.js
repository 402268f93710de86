// What tools/k8s-validate.js, tools/k8s-flags.js and tests/deploy/*.js share:
// exit codes (0 fine, 1 a problem found, 2 usage or input errors: a crash must
// not look like a found problem), reading the Kubernetes objects of rendered
// manifests, and a container's command line as the kubelet expands it.
'use strict';

const fs = require('fs');

// Installs the crash handler; returns die(msg) for usage and input errors,
// which prints "<tool>: msg" and exits 2.
function start(tool) {
  process.on('uncaughtException', (e) => {
    process.stderr.write(`${e.stack || e}\n`);
    process.exit(2);
  });
  return (msg) => {
    process.stderr.write(`${tool}: ${msg}\n`);
    process.exit(2);
  };
}

// require() of an npm package that tools/setup installs, or die.
function requirePackage(name, die) {
  try {
    return require(name);
  } catch (e) {
    die(`npm package ${name} missing (${e.message.split('\n')[0]}); run tools/setup`);
  }
}

// The YAML documents of `files` ('-': standard input), empty ones left out,
// as [{file, doc}]; dies when a file cannot be read or is not YAML, or when
// there is no document at all.
function readDocuments(files, die) {
  const yaml = requirePackage('js-yaml', die);
  const out = [];
  for (const f of files) {
    let text;
    try {
      text = fs.readFileSync(f === '-' ? 0 : f, 'utf8');
    } catch (e) {
      die(`cannot read ${f}: ${e.message}`);
    }
    let docs;
    try {
      docs = yaml.loadAll(text);
    } catch (e) {
      die(`${f}: not YAML: ${e.message}`);
    }
    for (const doc of docs) {
      if (doc !== null && doc !== undefined) out.push({file: f, doc});
    }
  }
  if (out.length === 0) die(`no objects in ${files.join(' ')}`);
  return out;
}

// Whether a document is an object (not a scalar or a list).
function isObject(doc) {
  return typeof doc === 'object' && !Array.isArray(doc);
}

// The value of the env var `name` of container `c` as the manifests `docs`
// give it (a value, or a key of a ConfigMap in them), or undefined (not set,
// or known only on the cluster: a fieldRef, a Secret).
function envValue(c, name, docs) {
  const e = (c.env || []).find((v) => v.name === name);
  if (!e) return undefined;
  if (e.value !== undefined) return String(e.value);
  const ref = e.valueFrom && e.valueFrom.configMapKeyRef;
  if (!ref) return undefined;
  const cm = docs.find((d) => isObject(d) && d.kind === 'ConfigMap' && d.metadata &&
                              d.metadata.name === ref.name);
  return cm && cm.data && cm.data[ref.key] !== undefined ? String(cm.data[ref.key]) : undefined;
}

// Container `c`'s command and args with $(VAR) expanded as the kubelet does
// where envValue knows VAR ($$ escapes a $); unknown ones stay as written.
function expandedArgv(c, docs) {
  return [...(c.command || []), ...(c.args || [])].map((a) => String(a).replace(
      /\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, name) => {
        if (m === '$$') return '$';
        const v = envValue(c, name, docs);
        return v === undefined ? m : v;
      }));
}

module.exports = {start, requirePackage, readDocuments, isObject, envValue, expandedArgv};
