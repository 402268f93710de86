#!/usr/bin/env node
// Offline check of a Grafana dashboard (tests/deploy/check.sh dashboard FILE):
//   node tests/deploy/dashboard.js [--metrics coordinator/job_metrics.cc ...] deploy/grafana/onebit-ps.json
// The metric families and their labels are read from the C++ sources that
// define them (--metrics, repeatable; default coordinator/job_metrics.cc,
// server/server_metrics.cc, worker/worker_metrics.cc): every string
// literal "onebit_..." passed to NewGauge, NewCounter, NewSeconds or
// GaugeFamily, or to a MetricFactory's .Gauge, .Counter, .Histogram or
// .GaugeFamily (metrics/families.h), with the label keys and values of the
// {{"key", "value"}} written in that call (a value computed there: any); every series also carries the
// role its folder names (role="coordinator", "server", "worker": the
// endpoint's label), a server's a shard and a worker's a rank label, and
// the labels Prometheus adds to a target (job, instance; namespace, pod,
// container, endpoint, service under Kubernetes). A histogram (NewSeconds,
// .Histogram) F provides F_bucket (with le), F_sum, F_count.
// Asserts:
// - the file is JSON with a panels list, a schemaVersion, a uid and a title;
// - a templating variable "datasource" of type datasource (prometheus), and
//   every panel and target names it (${datasource}); every other $variable
//   an expr uses is defined;
// - every panel has a unique id, a gridPos {x, y, w, h} inside the 24
//   columns, no two panels overlap; every panel but a row has a title,
//   targets with an expr and a unique refId each;
// - every expr names only metric families that the source defines, with
//   only labels they have (in {matchers} and by/without clauses), and
//   label values they have where the source fixes them (direction="up");
// - where promtool (Debian's prometheus) is found (--promtool PATH; "none"
//   skips it), every expr parses as PromQL: each becomes a recording rule,
//   Grafana's variables replaced ($__rate_interval by 1m, others by .*),
//   and `promtool check rules` must accept the file.
// Exit 0: fine; 1: problems, printed as "panel <id> "<title>": <what>" (or
// "dashboard: <what>"); 2: usage or input errors.
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const {execFileSync} = require('child_process');
const {start} = require('../../tools/k8s-common');

const die = start('dashboard');
const args = process.argv.slice(2);
let metricsFiles = [];
let promtool = 'auto';
const files = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === '--metrics') metricsFiles.push(args[++i]);
  else if (args[i] === '--promtool') promtool = args[++i];
  else if (!args[i].startsWith('--')) files.push(args[i]);
  else die(`unknown option ${args[i]}`);
}
if (files.length !== 1) die('usage: dashboard.js [--metrics job_metrics.cc ...] DASHBOARD.json');
if (!metricsFiles.length) {
  metricsFiles = ['coordinator/job_metrics.cc', 'server/server_metrics.cc', 'worker/worker_metrics.cc']
      .map((f) => path.join(__dirname, '../..', f));
}
const metricsNames = metricsFiles.map((f) => path.basename(f)).join(', ');
// The labels each role's endpoint and factory give all its series.
const ROLE_LABELS = {server: ['shard'], worker: ['rank']};

// --- The families: name -> {labels: Map(key -> Set(values) | null), histogram}
const TARGET_LABELS = ['role', 'job', 'instance', 'namespace', 'pod', 'container', 'endpoint', 'service'];
function readFamilies(file, series) {
  const role = path.basename(path.dirname(path.resolve(file)));
  let src;
  try {
    src = fs.readFileSync(file, 'utf8');
  } catch (e) {
    die(`cannot read ${file}: ${e.message}`);
  }
  src = src.replace(/\/\/[^\n]*/g, '');  // comments may name metrics too
  const families = new Map();
  const call = /(?:\b(NewGauge|NewCounter|NewSeconds|GaugeFamily)\(\s*[A-Za-z_]\w*\s*,|\.(Gauge|Counter|Histogram|GaugeFamily)\()\s*"(onebit_\w+)"/g;
  for (let m; (m = call.exec(src));) {
    // The call's text up to its closing parenthesis (strings skipped).
    let depth = 1;
    let j = call.lastIndex;
    for (; j < src.length && depth > 0; j++) {
      if (src[j] === '"') {
        for (j++; j < src.length && src[j] !== '"'; j++) if (src[j] === '\\') j++;
      } else if (src[j] === '(') depth++;
      else if (src[j] === ')') depth--;
    }
    const text = src.slice(call.lastIndex, j);
    const kind = m[1] || m[2];
    const name = m[3];
    const fam = families.get(name) || {labels: new Map(), histogram: false};
    fam.histogram = fam.histogram || kind === 'NewSeconds' || kind === 'Histogram';
    // {"key", "value"}, or {"key", an expression}: a label of any value.
    for (const l of text.matchAll(/\{\s*"(\w+)"\s*,\s*(?:"([^"]*)"|[^{}"]+)\s*\}/g)) {
      if (l[2] === undefined) {
        fam.labels.set(l[1], null);
        continue;
      }
      if (!fam.labels.has(l[1])) fam.labels.set(l[1], new Set());
      if (fam.labels.get(l[1])) fam.labels.get(l[1]).add(l[2]);
    }
    families.set(name, fam);
  }
  if (families.size === 0) die(`${file}: no onebit_ metric families found (NewGauge/NewCounter/NewSeconds/GaugeFamily)`);
  // Series names: F, and F_bucket/_sum/_count of a histogram.
  for (const [name, fam] of families) {
    const labels = new Map(fam.labels);
    for (const t of TARGET_LABELS) if (!labels.has(t)) labels.set(t, null);
    for (const t of ROLE_LABELS[role] || []) if (!labels.has(t)) labels.set(t, null);
    labels.set('role', new Set([role]));
    if (!fam.histogram) {
      series.set(name, labels);
      continue;
    }
    series.set(`${name}_bucket`, new Map([...labels, ['le', null]]));
    series.set(`${name}_sum`, labels);
    series.set(`${name}_count`, labels);
  }
}
const series = new Map();  // series name -> Map(label -> Set | null)
for (const f of metricsFiles) readFamilies(f, series);

// --- The dashboard ----------------------------------------------------------
let dash;
try {
  dash = JSON.parse(fs.readFileSync(files[0], 'utf8'));
} catch (e) {
  process.stdout.write(`dashboard: ${files[0]}: not valid JSON: ${e.message}\n`);
  process.exit(1);
}
const problems = [];
const top = (what) => problems.push(`dashboard: ${what}`);
if (typeof dash !== 'object' || dash === null || Array.isArray(dash)) {
  top('not a JSON object');
  dash = {};
}
for (const k of ['title', 'uid']) if (typeof dash[k] !== 'string' || !dash[k]) top(`no ${k}`);
if (!Number.isInteger(dash.schemaVersion)) top('no schemaVersion');
if (!Array.isArray(dash.panels) || !dash.panels.length) top('no panels');

const vars = ((dash.templating || {}).list || []);
const varNames = new Set(vars.map((v) => v.name));
const dsVar = vars.find((v) => v.name === 'datasource');
if (!dsVar || dsVar.type !== 'datasource' || dsVar.query !== 'prometheus') {
  top('no templating variable "datasource" of type datasource, query prometheus');
}
// Grafana's built-in variables, usable in any expr.
const BUILTIN = new Set(['__interval', '__rate_interval', '__range', '__range_s', '__interval_ms', '__name',
                         '__dashboard', '__from', '__to', 'interval', 'timeFilter']);
const isDatasourceRef = (ds) => ds && typeof ds === 'object' && ds.type === 'prometheus' &&
    (ds.uid === '${datasource}' || ds.uid === '$datasource');

// The series names (with their {matchers}) and the grouping labels
// (by/without/on/ignoring) of a PromQL expression, by a small lexer.
const GROUPING = new Set(['by', 'without', 'on', 'ignoring', 'group_left', 'group_right']);
const KEYWORDS = new Set(['and', 'or', 'unless', 'bool', 'offset', 'inf', 'nan']);
const AGGREGATIONS = new Set(['sum', 'avg', 'min', 'max', 'count', 'stddev', 'stdvar', 'topk', 'bottomk',
                              'quantile', 'count_values', 'group', 'limitk', 'limit_ratio']);
function parseExpr(expr) {
  const selectors = [];  // {name, matchers: [[key, op, value]]}
  const grouping = [];   // [keyword, label]
  const err = [];
  let i = 0;
  const skipSpace = () => { while (i < expr.length && /\s/.test(expr[i])) i++; };
  const readString = () => {  // at a quote; returns the value
    const q = expr[i++];
    let v = '';
    for (; i < expr.length && expr[i] !== q; i++) v += expr[i] === '\\' ? expr[++i] : expr[i];
    i++;
    return v;
  };
  const readMatchers = () => {  // at "{"
    const out = [];
    i++;
    for (;;) {
      skipSpace();
      if (i >= expr.length) { err.push('unclosed {'); break; }
      if (expr[i] === '}') { i++; break; }
      if (expr[i] === ',') { i++; continue; }
      const m = expr.slice(i).match(/^([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*/);
      if (!m || !/["'`]/.test(expr[i + m[0].length] || '')) {
        err.push(`cannot read the matchers at "${expr.slice(i, i + 20)}"`);
        break;
      }
      i += m[0].length;
      out.push([m[1], m[2], readString()]);
    }
    return out;
  };
  while (i < expr.length) {
    const c = expr[i];
    if (/\s/.test(c)) { i++; continue; }
    if (c === '"' || c === "'" || c === '`') { readString(); continue; }
    if (c === '[') { const j = expr.indexOf(']', i); i = j < 0 ? expr.length : j + 1; continue; }
    if (c === '{') { selectors.push({name: null, matchers: readMatchers()}); continue; }
    if (c === '$') { const m = expr.slice(i).match(/^\$\{?\w+\}?/); i += m ? m[0].length : 1; continue; }
    const num = expr.slice(i).match(/^(0x[0-9a-f]+|[0-9][0-9.]*(e[+-]?[0-9]+)?[a-z]*)/i);
    if (num) { i += num[0].length; continue; }
    const id = expr.slice(i).match(/^[a-zA-Z_:][\w:]*/);
    if (!id) { i++; continue; }
    i += id[0].length;
    const word = id[0];
    skipSpace();
    if (GROUPING.has(word)) {
      if (expr[i] === '(') {
        const j = expr.indexOf(')', i);
        for (const l of expr.slice(i + 1, j < 0 ? expr.length : j).split(',')) if (l.trim()) grouping.push([word, l.trim()]);
        i = j < 0 ? expr.length : j + 1;
      }
      continue;
    }
    if (KEYWORDS.has(word.toLowerCase())) continue;
    if (expr[i] === '(') continue;  // a function or an aggregation
    if (AGGREGATIONS.has(word) && /^(by|without)\b/.test(expr.slice(i))) continue;  // sum by (...) (...)
    selectors.push({name: word, matchers: expr[i] === '{' ? readMatchers() : []});
  }
  return {selectors, grouping, err};
}

function exprProblems(expr) {
  const out = [];
  for (const m of expr.matchAll(/\$\{?([A-Za-z_]\w*)/g)) {  // not $1 of label_replace
    if (!varNames.has(m[1]) && !BUILTIN.has(m[1])) out.push(`uses $${m[1]}, which no templating variable defines`);
  }
  const {selectors, grouping, err} = parseExpr(expr);
  out.push(...err);
  const known = [];
  for (const {name, matchers} of selectors) {
    const nameMatcher = matchers.find(([k]) => k === '__name__');
    const n = name || (nameMatcher && nameMatcher[1] === '=' ? nameMatcher[2] : null);
    if (!n) {
      out.push('a selector without a metric name');
      continue;
    }
    const labels = series.get(n);
    if (!labels) {
      out.push(`${n}: no such metric family in ${metricsNames}`);
      continue;
    }
    known.push(labels);
    for (const [key, op, value] of matchers) {
      if (key === '__name__') continue;
      if (!labels.has(key)) {
        out.push(`${n}: has no label ${key} (it has ${[...labels.keys()].join(', ')})`);
        continue;
      }
      const values = labels.get(key);
      if (op === '=' && values && !value.includes('$') && !values.has(value)) {
        out.push(`${n}{${key}="${value}"}: ${key} is never "${value}" (${[...values].join(', ')})`);
      }
    }
  }
  for (const [word, key] of grouping) {
    if (!known.some((labels) => labels.has(key))) out.push(`${word} (${key}): no metric of the expression has label ${key}`);
  }
  return out;
}

const exprs = [];  // {expr, where}: every target's, for promtool
const ids = new Map();
const boxes = [];
function checkPanel(p, where) {
  const name = `panel ${p.id === undefined ? '?' : p.id} "${p.title || ''}"`;
  const add = (what) => problems.push(`${name}: ${what}`);
  if (!Number.isInteger(p.id)) add('no integer id');
  else if (ids.has(p.id)) add(`id ${p.id} repeats (also ${ids.get(p.id)})`);
  else ids.set(p.id, name);
  if (typeof p.type !== 'string' || !p.type) add('no type');
  const g = p.gridPos;
  if (!g || ![g.x, g.y, g.w, g.h].every(Number.isInteger)) {
    add('no gridPos {x, y, w, h}');
  } else if (g.x < 0 || g.y < 0 || g.w < 1 || g.h < 1 || g.x + g.w > 24) {
    add(`gridPos ${JSON.stringify(g)} is outside the 24 columns`);
  } else {
    for (const b of boxes) {
      if (g.x < b.g.x + b.g.w && b.g.x < g.x + g.w && g.y < b.g.y + b.g.h && b.g.y < g.y + g.h) {
        add(`gridPos ${JSON.stringify(g)} overlaps ${b.name} ${JSON.stringify(b.g)}`);
      }
    }
    boxes.push({g, name});
  }
  if (p.type === 'row') {
    for (const q of p.panels || []) checkPanel(q, name);  // a collapsed row's panels
    return;
  }
  if (!p.title) add('no title');
  if (!isDatasourceRef(p.datasource)) add('datasource is not {type: prometheus, uid: ${datasource}}');
  if (!Array.isArray(p.targets) || !p.targets.length) {
    add('no targets');
    return;
  }
  const refIds = new Set();
  p.targets.forEach((t, i) => {
    if (typeof t.expr === 'string' && t.expr.trim()) exprs.push({expr: t.expr, where: `${name}: targets[${i}] (${t.refId})`});
    if (!t.refId) add(`targets[${i}]: no refId`);
    else if (refIds.has(t.refId)) add(`targets[${i}]: refId ${t.refId} repeats`);
    refIds.add(t.refId);
    if (t.datasource !== undefined && !isDatasourceRef(t.datasource)) {
      add(`targets[${i}]: datasource is not {type: prometheus, uid: \${datasource}}`);
    }
    if (typeof t.expr !== 'string' || !t.expr.trim()) {
      add(`targets[${i}]: no expr`);
      return;
    }
    for (const e of exprProblems(t.expr)) add(`targets[${i}] (${t.refId}): ${e}`);
  });
}
for (const p of Array.isArray(dash.panels) ? dash.panels : []) checkPanel(p);
// The other variables' queries name metrics and labels too.
for (const v of vars) {
  if (v.type !== 'query') continue;
  const q = typeof v.query === 'string' ? v.query : (v.query || {}).query || '';
  const lv = q.match(/^label_values\((.*),\s*(\w+)\)$/);
  const expr = lv ? lv[1] : q;
  for (const e of exprProblems(expr)) top(`variable ${v.name}: ${e}`);
  if (lv) {
    const {selectors} = parseExpr(expr);
    if (selectors.some((sel) => series.has(sel.name) && !series.get(sel.name).has(lv[2]))) {
      top(`variable ${v.name}: ${expr} has no label ${lv[2]}`);
    }
  }
}

// PromQL syntax, by promtool where there is one.
let promtoolNote = '';
if (promtool === 'auto') {
  promtool = null;
  for (const dir of (process.env.PATH || '').split(':')) {
    if (dir && fs.existsSync(path.join(dir, 'promtool'))) {
      promtool = path.join(dir, 'promtool');
      break;
    }
  }
} else if (promtool === 'none') {
  promtool = null;
}
if (promtool && exprs.length) {
  const rules = exprs.map((e, i) => ({
    record: `onebit_dashboard:expr_${i}`,
    expr: e.expr.replace(/\$\{?__(rate_)?interval\}?|\$\{?__range\}?/g, '1m').replace(/\$\{?\w+\}?/g, '.*'),
  }));
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'dashboard-'));
  const file = path.join(dir, 'rules.yml');
  fs.writeFileSync(file, JSON.stringify({groups: [{name: 'dashboard', rules}]}, null, 1));  // JSON is YAML
  let out = '';
  let failed = false;
  try {
    execFileSync(promtool, ['check', 'rules', file], {encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe']});
  } catch (e) {
    if (e.status === undefined || e.status === null) die(`cannot run ${promtool}: ${e.message}`);
    out = `${e.stdout || ''}${e.stderr || ''}`;
    failed = true;
  }
  fs.rmSync(dir, {recursive: true, force: true});
  if (failed) {
    let mapped = 0;
    for (const m of out.matchAll(/rule (\d+), "[^"]*": (.*)/g)) {
      const e = exprs[Number(m[1]) - 1];
      if (e) {
        problems.push(`${e.where}: promtool: ${m[2]}`);
        mapped++;
      }
    }
    if (!mapped) problems.push(`dashboard: promtool check rules failed:\n${out}`);
  }
  promtoolNote = `, ${exprs.length} exprs parsed by promtool`;
} else {
  promtoolNote = ' (no promtool: PromQL syntax not checked)';
}

for (const p of problems) process.stdout.write(`${p}\n`);
if (problems.length) {
  process.stdout.write(`dashboard: ${problems.length} problem(s) in ${files[0]}\n`);
  process.exit(1);
}
process.stdout.write(`dashboard: ${files[0]}: ${ids.size} panels, every expr over the ${series.size} series ` +
                     `that ${metricsNames} defines${promtoolNote}\n`);
