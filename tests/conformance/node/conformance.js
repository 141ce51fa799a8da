#!/usr/bin/env node
// kvstore.v1 conformance from another language: a client written from proto/kvstore/v1/kvstore.proto and
// DESIGN 2.1 alone (grpc-js, proto-loader, blakejs, crc-32's CRC32C), run against a real `kvstore serve`.
//
//   node conformance.js --target HOST:PORT --proto DIR --vectors FILE --namespace NS --token T --foreign NS2
//
// The server must run with a tenants file in which token T reaches namespace NS and not NS2. Each check prints
// one JSON line {"check", "ok", "detail"}; the last line is "N passed, N failed"; the exit code is 0 only when
// every check passed.
"use strict";

const fs = require("fs");
const path = require("path");
const crypto = require("crypto");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const { blake2b } = require("blakejs");
const CRC32C = require("crc-32/crc32c");

const INVALID_ARGUMENT = grpc.status.INVALID_ARGUMENT;

function parseArgs(argv) {
  const out = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith("--")) throw new Error(`unexpected argument ${argv[i]}`);
    out[argv[i].slice(2)] = argv[i + 1];
  }
  for (const need of ["target", "proto", "vectors", "namespace", "token", "foreign"]) {
    if (!out[need]) throw new Error(`--${need} is required`);
  }
  return out;
}

// -- DESIGN 2.1: block identity ------------------------------------------------------------------------------
const utf8 = (s) => Buffer.from(s, "utf8");
const b2b128 = (bytes) => Buffer.from(blake2b(bytes, undefined, 16));

function rootHash(namespace, fingerprint) {
  return b2b128(Buffer.concat([utf8("kvstore/v1\0"), utf8(namespace), Buffer.from([0]), utf8(fingerprint)]));
}

function blockHashes(tokens, blockSize, namespace, fingerprint) {
  let prev = rootHash(namespace, fingerprint);
  const out = [];
  for (let i = 0; (i + 1) * blockSize <= tokens.length; i++) {
    const block = Buffer.alloc(4 * blockSize);
    for (let j = 0; j < blockSize; j++) block.writeUInt32LE(tokens[i * blockSize + j], 4 * j);
    prev = b2b128(Buffer.concat([prev, block]));
    out.push(prev);
  }
  return out;
}

const crc32c = (buf) => CRC32C.buf(buf) >>> 0;

// -- the wire ----------------------------------------------------------------------------------------------------
function connect(args) {
  const def = protoLoader.loadSync("kvstore/v1/kvstore.proto", {
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
    includeDirs: [args.proto],
  });
  const KVStore = grpc.loadPackageDefinition(def).kvstore.v1.KVStore;
  // grpc-js's default 64 KiB receive window halves Get throughput; a larger one is what docs/wire.md advises.
  return new KVStore(args.target, grpc.credentials.createInsecure(), {
    "grpc.max_receive_message_length": 8 << 20,
    "grpc-node.flow_control_window": 16 << 20,
  });
}

function auth(token) {
  const md = new grpc.Metadata();
  md.set("authorization", `Bearer ${token}`);
  return md;
}

const unary = (client, method, request, md) =>
  new Promise((resolve, reject) => {
    client[method](request, md, { deadline: Date.now() + 20000 }, (err, reply) => (err ? reject(err) : resolve(reply)));
  });

// A Put stream: one header per block, its bytes in chunks of at most 1 MiB (the first chunk rides in the header's
// message). `blocks` are {hash, parent, data, dtype, crc}; `extra` are raw PutRequest messages sent after them.
function put(client, namespace, blocks, md, extra = []) {
  return new Promise((resolve, reject) => {
    const call = client.Put(md, { deadline: Date.now() + 30000 }, (err, reply) => (err ? reject(err) : resolve(reply)));
    let first = true;
    const send = (msg) => {
      if (first) msg.namespace = namespace;
      first = false;
      call.write(msg);
    };
    for (const b of blocks) {
      const header = {
        hash: b.hash,
        parent: b.parent || Buffer.alloc(0),
        codec: "CODEC_NONE",
        raw_length: b.data.length,
        stored_length: b.data.length,
        crc32c: b.crc === undefined ? crc32c(b.data) : b.crc,
        dtype: b.dtype === undefined ? "uint8" : b.dtype,
      };
      const CHUNK = 1 << 20;
      send({ header, data: b.data.subarray(0, CHUNK) });
      for (let off = CHUNK; off < b.data.length; off += CHUNK) send({ data: b.data.subarray(off, off + CHUNK) });
    }
    for (const msg of extra) send(msg);
    call.end();
  });
}

// A Get stream reassembled into blocks: [{header, data}] in request order.
function get(client, request, md) {
  return new Promise((resolve, reject) => {
    const blocks = [];
    const call = client.Get(request, md, { deadline: Date.now() + 30000 });
    call.on("data", (msg) => {
      if (msg.header) blocks.push({ header: msg.header, parts: [] });
      if (msg.data && msg.data.length) blocks[blocks.length - 1].parts.push(msg.data);
    });
    call.on("error", reject);
    call.on("end", () => resolve(blocks.map((b) => ({ header: b.header, data: Buffer.concat(b.parts) }))));
  });
}

async function rpcError(promise) {
  try {
    await promise;
  } catch (err) {
    return err;
  }
  throw new Error("the call succeeded; an error status was expected");
}

function expect(cond, what) {
  if (!cond) throw new Error(what);
}

// A chain of `n` blocks for `label` (its own model fingerprint, so no check sees another's blocks).
function chain(args, label, n, sizes) {
  const tokens = Array.from({ length: 16 * n }, (_, i) => (i * 2654435761 + label.length) >>> 0);
  const hashes = blockHashes(tokens, 16, args.namespace, `conformance;check=${label}`);
  return hashes.map((hash, i) => ({
    hash,
    parent: i === 0 ? Buffer.alloc(0) : hashes[i - 1],
    data: crypto.randomBytes(sizes ? sizes[i] : 4096),
  }));
}

// -- the checks --------------------------------------------------------------------------------------------------
const checks = [];
const check = (name, fn) => checks.push({ name, fn });

check("hash vectors (DESIGN 2.1)", async ({ args }) => {
  const vectors = JSON.parse(fs.readFileSync(args.vectors, "utf8")).cases;
  const bad = [];
  for (const v of vectors) {
    const root = rootHash(v.namespace, v.model_fingerprint).toString("hex");
    const got = blockHashes(v.tokens, v.block_size, v.namespace, v.model_fingerprint).map((h) => h.toString("hex"));
    if (root !== v.root || JSON.stringify(got) !== JSON.stringify(v.hashes)) bad.push(v.name);
  }
  expect(vectors.length >= 22, `only ${vectors.length} vectors`);
  expect(bad.length === 0, `mismatched vectors: ${bad.join(", ")}`);
  return `${vectors.length} vectors match`;
});

check("chained Put, Lookup, Get, Delete", async ({ client, args, md }) => {
  const blocks = chain(args, "chain", 4, [4096, 4096, (2 << 20) + 12345, 512]); // block 2 spans three chunks
  blocks[1].dtype = "bfloat16";
  const reply = await put(client, args.namespace, blocks, md);
  expect(reply.results.length === 4, `${reply.results.length} results for 4 blocks`);
  reply.results.forEach((r, i) => {
    expect(r.status === "PUT_STORED", `block ${i}: ${r.status} ${r.reason}`);
    expect(Buffer.compare(r.hash, blocks[i].hash) === 0, `block ${i}: result hash differs`);
  });
  const again = await put(client, args.namespace, blocks.slice(0, 2), md);
  expect(again.results.every((r) => r.status === "PUT_ALREADY_PRESENT"), "a second Put was not ALREADY_PRESENT");

  const hashes = blocks.map((b) => b.hash);
  const stranger = Buffer.alloc(16, 0xab);
  const all = await unary(client, "Lookup", { namespace: args.namespace, hashes: [...hashes, stranger] }, md);
  expect(all.prefix_length === 4, `prefix_length ${all.prefix_length}, expected 4`);
  expect(all.tiers.length === 4 && all.tiers.every((t) => t === "TIER_DRAM"), `tiers ${all.tiers}`);
  const gap = await unary(client, "Lookup", { namespace: args.namespace, hashes: [hashes[0], stranger, hashes[2]] }, md);
  expect(gap.prefix_length === 1, `a gap after block 0: prefix_length ${gap.prefix_length}`);

  const got = await get(client, { namespace: args.namespace, hashes }, md);
  expect(got.length === 4, `${got.length} blocks back`);
  got.forEach((b, i) => {
    expect(Buffer.compare(b.header.hash, hashes[i]) === 0, `block ${i}: out of order`);
    expect(b.header.codec === "CODEC_NONE", `block ${i}: codec ${b.header.codec} though none was accepted`);
    expect(b.header.stored_length === b.data.length, `block ${i}: ${b.data.length} bytes, header ${b.header.stored_length}`);
    expect(crc32c(b.data) === b.header.crc32c, `block ${i}: CRC32C of the bytes differs from the header's`);
    expect(Buffer.compare(b.data, blocks[i].data) === 0, `block ${i}: bytes differ from what was put`);
    expect(b.header.dtype === (blocks[i].dtype || "uint8"), `block ${i}: dtype ${b.header.dtype}`);
  });
  const deleted = await unary(client, "Delete", { namespace: args.namespace, hashes: [hashes[3]] }, md);
  expect(deleted.deleted === 1, `deleted ${deleted.deleted}`);
  const after = await unary(client, "Lookup", { namespace: args.namespace, hashes }, md);
  expect(after.prefix_length === 3, `after Delete: prefix_length ${after.prefix_length}`);
  return "4 blocks (one of 2 MiB+) stored, found, read back with matching CRC32C, one deleted";
});

check("a bad CRC rejects that block alone (INVALID_ARGUMENT in its result)", async ({ client, args, md }) => {
  const blocks = chain(args, "badcrc", 3);
  blocks[1].crc = (crc32c(blocks[1].data) ^ 1) >>> 0;
  const reply = await put(client, args.namespace, blocks, md);
  const statuses = reply.results.map((r) => r.status);
  expect(JSON.stringify(statuses) === JSON.stringify(["PUT_STORED", "PUT_REJECTED", "PUT_STORED"]), `statuses ${statuses}`);
  const bad = reply.results[1];
  expect(bad.code === INVALID_ARGUMENT, `code ${bad.code}, expected ${INVALID_ARGUMENT}`);
  expect(/CRC32C/.test(bad.reason), `reason ${JSON.stringify(bad.reason)}`);
  const present = [];
  for (const b of blocks) {
    present.push((await unary(client, "Lookup", { namespace: args.namespace, hashes: [b.hash] }, md)).prefix_length);
  }
  expect(JSON.stringify(present) === "[1,0,1]", `present ${present}`);
  return `reason: ${bad.reason}`;
});

check("a malformed stream aborts and says how many blocks were handled", async ({ client, args, md }) => {
  const blocks = chain(args, "abort", 2);
  const err = await rpcError(put(client, args.namespace, blocks, md, [{ data: Buffer.from("stray") }]));
  expect(err.code === INVALID_ARGUMENT, `code ${err.code}`);
  const handled = err.metadata.get("kvstore-put-blocks-handled");
  expect(handled.length === 1 && String(handled[0]) === "2", `kvstore-put-blocks-handled ${handled}`);
  const n = await unary(client, "Lookup", { namespace: args.namespace, hashes: blocks.map((b) => b.hash) }, md);
  expect(n.prefix_length === 2, `blocks before the fault: prefix_length ${n.prefix_length}`);
  return err.details;
});

for (const dtype of ["", "float64"]) {
  check(`dtype ${JSON.stringify(dtype)} is INVALID_ARGUMENT naming the allowed names`, async ({ client, args, md }) => {
    const [block] = chain(args, `dtype-${dtype}`, 1);
    block.dtype = dtype;
    const err = await rpcError(put(client, args.namespace, [block], md));
    expect(err.code === INVALID_ARGUMENT, `code ${err.code}`);
    for (const name of ["bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8"]) {
      expect(err.details.includes(name), `the message does not name ${name}: ${err.details}`);
    }
    return err.details;
  });
}

check("Get of an absent block: NOT_FOUND, or a missing header with allow_missing", async ({ client, args, md }) => {
  const [block] = chain(args, "absent", 1);
  const err = await rpcError(get(client, { namespace: args.namespace, hashes: [block.hash] }, md));
  expect(err.code === grpc.status.NOT_FOUND, `code ${err.code}`);
  const got = await get(client, { namespace: args.namespace, hashes: [block.hash], allow_missing: true }, md);
  expect(got.length === 1 && got[0].header.missing === true && got[0].data.length === 0, "no missing header");
  return "NOT_FOUND; header{missing: true}";
});

check("an unknown token is UNAUTHENTICATED", async ({ client, args }) => {
  const req = { namespace: args.namespace, hashes: [Buffer.alloc(16)] };
  const err = await rpcError(unary(client, "Lookup", req, auth("not-a-token-of-this-node")));
  expect(err.code === grpc.status.UNAUTHENTICATED, `code ${err.code}`);
  return err.details;
});

check("another tenant's namespace is PERMISSION_DENIED", async ({ client, args, md }) => {
  const err = await rpcError(unary(client, "Lookup", { namespace: args.foreign, hashes: [Buffer.alloc(16)] }, md));
  expect(err.code === grpc.status.PERMISSION_DENIED, `code ${err.code}`);
  return err.details;
});

check("Stats of the namespace", async ({ client, args, md }) => {
  const s = await unary(client, "Stats", { namespace: args.namespace }, md);
  // chain: 3 left after the Delete; bad CRC: 2; abort: 2
  expect(s.blocks === 7, `blocks ${s.blocks}, expected 7`);
  expect(s.lookups === 0 && s.lookup_hashes === 0 && s.bytes_in === 0, "node-wide counters in a namespace Stats");
  expect(s.counters.namespace_bytes > 0, "no namespace_bytes counter");
  return `blocks ${s.blocks}, namespace_bytes ${s.counters.namespace_bytes}`;
});

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const client = connect(args);
  const ctx = { client, args, md: auth(args.token) };
  let passed = 0;
  let failed = 0;
  for (const { name, fn } of checks) {
    try {
      const detail = await fn(ctx);
      passed++;
      console.log(JSON.stringify({ check: name, ok: true, detail }));
    } catch (err) {
      failed++;
      console.log(JSON.stringify({ check: name, ok: false, detail: String(err && err.stack ? err.stack : err) }));
    }
  }
  client.close();
  console.log(`${passed} passed, ${failed} failed`);
  process.exitCode = failed === 0 ? 0 : 1;
}

main().catch((err) => {
  console.error(err);
  process.exitCode = 2;
});
