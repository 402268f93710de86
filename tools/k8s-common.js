// What tools/k8s-validate.js and tools/k8s-flags.js share: exit codes (0 fine,
// 1 a problem found, 2 usage or input errors: a crash must not look like a
// found problem) and reading the Kubernetes objects of rendered manifests.
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

module.exports = {start, requirePackage, readDocuments, isObject};
