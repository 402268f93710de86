#!/usr/bin/env node
// Offline schema validation of rendered Kubernetes manifests (no cluster).
//   kubectl kustomize deploy/k8s/overlays/gpu | node tools/k8s-validate.js [-]
//   node tools/k8s-validate.js rendered.yaml...
// Every object is checked against the OpenAPI schema of its apiVersion/kind
// as shipped by the npm package kubernetes-models (installed by tools/setup
// into tools/node_modules). On top of the schema (which allows any extra
// field) a field the schema never looks at is reported as unknown, so a
// misspelt key (readinessprobe:) fails too. Exit 0: all valid; 1: a
// violation, printed as "<Kind>/<name>: <field path>: <message>"; 2: usage
// or input errors.
'use strict';

const {start, requirePackage, readDocuments, isObject} = require('./k8s-common');

const die = start('k8s-validate');
requirePackage('kubernetes-models/package.json', die);

// The kubernetes-models class for apiVersion/kind ("apps/v1" is the folder
// apps/v1, core "v1" is v1), or null.
function modelClass(apiVersion, kind) {
  let mod;
  try {
    mod = require(`kubernetes-models/${apiVersion}/${kind}`);
  } catch (e) {
    return null;
  }
  const cls = mod[kind];
  return typeof cls === 'function' && typeof cls.prototype.validate === 'function' ? cls : null;
}

// Runs the class's schema validator on `data` as it is (no copy, so the
// proxies below see every read). Returns the ajv errors, [] when valid.
function schemaErrors(cls, data) {
  try {
    cls.prototype.validate.call(data);
    return [];
  } catch (e) {
    if (Array.isArray(e.errors)) return e.errors;
    throw e;
  }
}

// Wraps `root` in proxies that record which keys of each object the schema
// validator reads. An object whose keys the validator enumerates (a map such
// as labels or data) counts as fully read.
function tracked(root) {
  const seen = new Map();  // target object -> {path, read: Set, all: bool}
  const proxies = new WeakMap();
  function wrap(obj, p) {
    if (obj === null || typeof obj !== 'object') return obj;
    if (proxies.has(obj)) return proxies.get(obj);
    const rec = {path: p, read: new Set(), all: false};
    seen.set(obj, rec);
    const proxy = new Proxy(obj, {
      get(t, key, recv) {
        if (typeof key === 'string') rec.read.add(key);
        const v = Reflect.get(t, key, recv);
        if (typeof key !== 'string' || v === null || typeof v !== 'object') return v;
        return wrap(v, `${p}/${key}`);
      },
      has(t, key) {
        if (typeof key === 'string') rec.read.add(key);
        return Reflect.has(t, key);
      },
      ownKeys(t) {
        rec.all = true;
        return Reflect.ownKeys(t);
      },
    });
    proxies.set(obj, proxy);
    return proxy;
  }
  return {proxy: wrap(root, ''), seen};
}

function unknownFields(seen) {
  const out = [];
  for (const [obj, rec] of seen) {
    if (rec.all || Array.isArray(obj)) continue;
    for (const key of Object.keys(obj)) {
      if (!rec.read.has(key)) out.push(`${rec.path}/${key}`);
    }
  }
  return out;
}

function validate(doc) {
  const name = `${doc.kind || '?'}/${(doc.metadata && doc.metadata.name) || '?'}`;
  if (!doc.apiVersion || !doc.kind) return [`${name}: missing apiVersion or kind`];
  const cls = modelClass(doc.apiVersion, doc.kind);
  if (!cls) return [`${name}: no schema for apiVersion ${doc.apiVersion} kind ${doc.kind}`];
  const {proxy, seen} = tracked(doc);
  const problems = [];
  const errors = schemaErrors(cls, proxy);
  for (const e of errors) {
    let detail = e.message || e.keyword;
    if (e.params && e.params.allowedValues) detail += ` (${e.params.allowedValues.join(', ')})`;
    if (e.params && e.params.missingProperty) detail += ` '${e.params.missingProperty}'`;
    problems.push(`${name}: ${e.instancePath || '/'}: ${detail}`);
  }
  for (const f of unknownFields(seen)) problems.push(`${name}: ${f}: unknown field`);
  return problems;
}

function main() {
  const files = process.argv.slice(2);
  if (files.length === 0) files.push('-');
  const problems = [];
  let count = 0;
  for (const {file, doc} of readDocuments(files, die)) {
    if (!isObject(doc)) {
      problems.push(`${file}: a document is not a Kubernetes object`);
      continue;
    }
    count++;
    problems.push(...validate(doc));
  }
  if (count === 0) die(`no objects in ${files.join(' ')}`);
  for (const p of problems) process.stdout.write(`${p}\n`);
  if (problems.length) {
    process.stdout.write(`k8s-validate: ${problems.length} violation(s) in ${count} objects\n`);
    process.exit(1);
  }
  process.stdout.write(`k8s-validate: ${count} objects valid\n`);
}

main();
