#!/usr/bin/env node
// Offline schema validation of rendered Kubernetes manifests (no cluster).
//   kubectl kustomize deploy/k8s/overlays/gpu | node tools/k8s-validate.js [-]
//   node tools/k8s-validate.js rendered.yaml...
// Every object is checked against the OpenAPI schema of its apiVersion/kind
// as shipped by the npm package kubernetes-models (installed by tools/setup
// into tools/node_modules). On top of the schema (which allows any extra
// field) a field the schema never looks at is reported as unknown, so a
// misspelt key (readinessprobe:) fails too. Kinds of custom resources that
// kubernetes-models does not ship are checked by a hand-written schema of
// the fields these manifests may use (CRD_SCHEMAS below: the Prometheus
// Operator's PodMonitor); any other kind is a violation ("no schema"), never
// passed unchecked. Exit 0: all valid; 1: a violation, printed as
// "<Kind>/<name>: <field path>: <message>"; 2: usage or input errors.
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

// Problems of `obj` at `at` against a kubernetes-models class of the
// apimachinery package (ObjectMeta, LabelSelector), unknown fields included.
function apimachineryProblems(name, at, type, obj) {
  const cls = require(`@kubernetes-models/apimachinery/apis/meta/v1/${type}`)[type];
  const {proxy, seen} = tracked(obj);
  const out = schemaErrors(cls, proxy).map((e) => {
    let detail = e.message || e.keyword;
    if (e.params && e.params.allowedValues) detail += ` (${e.params.allowedValues.join(', ')})`;
    return `${name}: ${at}${e.instancePath || ''}: ${detail}`;
  });
  for (const f of unknownFields(seen)) out.push(`${name}: ${at}${f}: unknown field`);
  return out;
}

// A Prometheus duration as the Prometheus Operator's CRDs accept it (30s, 1m30s).
const DURATION = /^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$/;

// Hand-written schemas of custom resources: "apiVersion kind" -> function
// (doc, name) returning problems. Only the fields listed are known (from the
// CRD, monitoring.coreos.com_podmonitors.yaml); nested objects these
// manifests do not use (relabelings, TLS, auth) are accepted as objects or
// lists without looking inside.
const PODMONITOR_SPEC = {
  selector: 'object', podMetricsEndpoints: 'array', namespaceSelector: 'object', jobLabel: 'string',
  podTargetLabels: 'array', sampleLimit: 'integer', targetLimit: 'integer', labelLimit: 'integer',
  labelNameLengthLimit: 'integer', labelValueLengthLimit: 'integer', keepDroppedTargets: 'integer',
  attachMetadata: 'object', scrapeProtocols: 'array', fallbackScrapeProtocol: 'string',
  scrapeClass: 'string', bodySizeLimit: 'string', selectMechanism: 'string',
  scrapeClassicHistograms: 'boolean', convertClassicHistogramsToNHCB: 'boolean',
  nativeHistogramBucketLimit: 'integer', nativeHistogramMinBucketFactor: 'any',
};
const PODMONITOR_ENDPOINT = {
  port: 'string', portNumber: 'integer', targetPort: 'any', path: 'string', scheme: 'string',
  params: 'object', interval: 'duration', scrapeTimeout: 'duration', honorLabels: 'boolean',
  honorTimestamps: 'boolean', trackTimestampsStaleness: 'boolean', metricRelabelings: 'array',
  relabelings: 'array', filterRunning: 'boolean', enableHttp2: 'boolean', followRedirects: 'boolean',
  proxyUrl: 'string', noProxy: 'string', proxyFromEnvironment: 'boolean', proxyConnectHeader: 'object',
  tlsConfig: 'object', authorization: 'object', basicAuth: 'object', oauth2: 'object',
  bearerTokenSecret: 'object',
};
function typeProblem(type, v) {
  switch (type) {
    case 'any': return null;
    case 'object': return isObject(v) && v !== null ? null : 'must be object';
    case 'array': return Array.isArray(v) ? null : 'must be array';
    case 'integer': return Number.isInteger(v) ? null : 'must be integer';
    case 'boolean': return typeof v === 'boolean' ? null : 'must be boolean';
    case 'string': return typeof v === 'string' ? null : 'must be string';
    case 'duration': return typeof v === 'string' && DURATION.test(v) ? null : 'must be a duration such as 30s';
    default: throw new Error(`unknown type ${type}`);
  }
}
// Problems of the fields of `obj` at `at` against `fields` (name -> type).
function fieldProblems(name, at, obj, fields) {
  const out = [];
  for (const [k, v] of Object.entries(obj)) {
    if (!(k in fields)) {
      out.push(`${name}: ${at}/${k}: unknown field`);
      continue;
    }
    const p = typeProblem(fields[k], v);
    if (p) out.push(`${name}: ${at}/${k}: ${p}`);
  }
  return out;
}
const CRD_SCHEMAS = {
  'monitoring.coreos.com/v1 PodMonitor': (doc, name) => {
    const out = fieldProblems(name, '', doc, {apiVersion: 'string', kind: 'string', metadata: 'object', spec: 'object'});
    if (!isObject(doc.metadata) || doc.metadata === null) return [...out, `${name}: /: must have required property 'metadata'`];
    out.push(...apimachineryProblems(name, '/metadata', 'ObjectMeta', doc.metadata));
    if (typeof doc.metadata.name !== 'string' || !doc.metadata.name) out.push(`${name}: /metadata/name: required`);
    const spec = doc.spec;
    if (!isObject(spec) || spec === null) return [...out, `${name}: /: must have required property 'spec'`];
    out.push(...fieldProblems(name, '/spec', spec, PODMONITOR_SPEC));
    if (!isObject(spec.selector) || spec.selector === null) {
      out.push(`${name}: /spec: must have required property 'selector'`);
    } else {
      out.push(...apimachineryProblems(name, '/spec/selector', 'LabelSelector', spec.selector));
      if (!Object.keys(spec.selector.matchLabels || {}).length && !(spec.selector.matchExpressions || []).length) {
        out.push(`${name}: /spec/selector: empty: selects every pod of the namespace`);
      }
    }
    const eps = spec.podMetricsEndpoints;
    if (!Array.isArray(eps) || !eps.length) {
      out.push(`${name}: /spec/podMetricsEndpoints: must be a non-empty array (nothing would be scraped)`);
      return out;
    }
    eps.forEach((ep, i) => {
      const at = `/spec/podMetricsEndpoints/${i}`;
      if (!isObject(ep) || ep === null) {
        out.push(`${name}: ${at}: must be object`);
        return;
      }
      out.push(...fieldProblems(name, at, ep, PODMONITOR_ENDPOINT));
      if (ep.port === undefined && ep.portNumber === undefined && ep.targetPort === undefined) {
        out.push(`${name}: ${at}: must have required property 'port' (the container port's name)`);
      }
      if (typeof ep.path === 'string' && !ep.path.startsWith('/')) out.push(`${name}: ${at}/path: must start with /`);
      if (ep.scheme !== undefined && !['http', 'https', 'HTTP', 'HTTPS'].includes(ep.scheme)) {
        out.push(`${name}: ${at}/scheme: must be equal to one of the allowed values (http, https)`);
      }
    });
    return out;
  },
};

function validate(doc) {
  const name = `${doc.kind || '?'}/${(doc.metadata && doc.metadata.name) || '?'}`;
  if (!doc.apiVersion || !doc.kind) return [`${name}: missing apiVersion or kind`];
  const crd = CRD_SCHEMAS[`${doc.apiVersion} ${doc.kind}`];
  if (crd) return crd(doc, name);
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
