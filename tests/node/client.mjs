// A wq gRPC worker in Node.js, built only from the project's .proto with @grpc/grpc-js and
// @grpc/proto-loader: the proof that workers in any language can use wq.
//
//   node client.mjs HOST:PORT [--enqueue N] [--consume M] [--prefetch P] [--fail-first] [--queues]
//                   [--produce B]
//
// Enqueues N tasks (unary Enqueue), then consumes M tasks over the StreamJobs stream, acking each
// on the stream (or, with --fail-first, nacking the first delivery), and prints one JSON line with
// what happened. With --queues it also exercises the named queues (queue, priority,
// idempotency_key, ExtendLease, ListQueues, a stream subscribed to a queue extending its lease,
// and the Drained answer), under "queues" in the JSON. With --produce it first sends B batches on
// one Produce stream, all before reading an answer, the second of them with an invalid task, then
// half-closes; the answers, in order, are under "produce".
import path from "node:path";
import { fileURLToPath } from "node:url";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const here = path.dirname(fileURLToPath(import.meta.url));
const protoRoot = path.resolve(here, "..", "..", "proto");

function parseArgs(argv) {
  const opts = { target: argv[0], enqueue: 0, consume: 0, prefetch: 4, failFirst: false };
  for (let i = 1; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--enqueue") opts.enqueue = Number(argv[++i]);
    else if (a === "--consume") opts.consume = Number(argv[++i]);
    else if (a === "--prefetch") opts.prefetch = Number(argv[++i]);
    else if (a === "--fail-first") opts.failFirst = true;
    else if (a === "--queues") opts.queues = true;
    else if (a === "--produce") opts.produce = Number(argv[++i]);
    else throw new Error(`unknown argument ${a}`);
  }
  if (!opts.target) throw new Error("usage: client.mjs HOST:PORT [--enqueue N] [--consume M]");
  return opts;
}

const opts = parseArgs(process.argv.slice(2));
const definition = protoLoader.loadSync("wqwire/pb/broker.proto", {
  includeDirs: [protoRoot],
  keepCase: true,
  longs: Number,
  defaults: true,
});
const wq = grpc.loadPackageDefinition(definition).wq.v1;
const client = new wq.Broker(opts.target, grpc.credentials.createInsecure());

const unary = (method, request) =>
  new Promise((resolve, reject) =>
    client[method](request, (err, response) => (err ? reject(err) : resolve(response))),
  );

const result = { enqueued: [], invalid_code: null, received: [], settled: [], max_unfinished: 0 };

// An invalid payload must be refused with INVALID_ARGUMENT (3).
try {
  await unary("Enqueue", { payload: Buffer.from("{not json") });
} catch (err) {
  result.invalid_code = err.code;
}

for (let i = 0; i < opts.enqueue; i++) {
  const payload = Buffer.from(JSON.stringify({ from: "node", i }));
  const { id } = await unary("Enqueue", { payload, max_attempts: 3 });
  result.enqueued.push(id);
}

if (opts.produce > 0) {
  result.produce = await new Promise((resolve, reject) => {
    const seen = { answers: [], status: null };
    const call = client.Produce();
    call.on("data", (r) =>
      seen.answers.push({ ids: r.ids, duplicates: r.duplicates, code: r.code, message: r.message }),
    );
    call.on("status", (status) => {
      seen.status = status.code;
      resolve(seen);
    });
    call.on("error", reject);
    for (let b = 0; b < opts.produce; b++) {
      const tasks = [0, 1, 2].map((i) => ({
        payload: Buffer.from(b === 1 && i === 2 ? "{not json" : JSON.stringify({ b, i })),
      }));
      call.write({ tasks });
    }
    call.end();
  });
}

if (opts.consume > 0) {
  await new Promise((resolve, reject) => {
    const call = client.StreamJobs();
    let unfinished = 0;
    let settledCount = 0;
    let failed = false;
    let stopping = false;
    call.on("data", (response) => {
      // Outcomes first: the slots they freed are what made room for this response's deliveries.
      for (const s of response.settled) {
        unfinished--;
        settledCount++;
        result.settled.push({ id: s.id, code: s.code, nack: s.nack });
      }
      for (const delivery of response.deliveries) {
        unfinished++;
        result.max_unfinished = Math.max(result.max_unfinished, unfinished);
        const task = delivery.task;
        result.received.push({
          id: task.id,
          payload: JSON.parse(Buffer.from(task.payload).toString("utf8")),
          attempts: task.attempts,
          deadline_s: Number(delivery.deadline.seconds),
        });
        const settle = { id: task.id, lease_id: delivery.lease_id };
        // Settle asynchronously, as a worker finishing work later would.
        setImmediate(() => {
          if (opts.failFirst && !failed) {
            failed = true;
            call.write({ nacks: [{ ...settle, error: "node says no" }] });
          } else {
            call.write({ acks: [settle] });
          }
        });
      }
      if (settledCount >= opts.consume && !stopping) {
        // Stop the pushes before ending, so no task is sent to a worker that is leaving. (The
        // broker answers the drain with one more response, `drained`: write nothing then.)
        stopping = true;
        call.write({ drain: true });
        call.end();
      }
    });
    call.on("end", resolve);
    call.on("error", reject);
    call.write({ open: { prefetch: opts.prefetch, lease_ms: 60000 } });
  });
}

// Named queues, priorities, keys, lease extension (unary and on a stream), and drain's answer.
async function queues() {
  const out = {};
  const enqueue = (priority, key) =>
    unary("Enqueue", {
      payload: Buffer.from(JSON.stringify({ priority })),
      queue: "node-q",
      priority,
      idempotency_key: key,
    });
  const low = await enqueue(1, "");
  const high = await enqueue(7, "node-key");
  const again = await enqueue(7, "node-key");
  out.enqueued = [low.id, high.id];
  out.duplicate = { id: again.id, duplicate: again.duplicate, first: high.duplicate };
  // The default queue has nothing: the claim names the queue.
  const idle = await unary("NextJob", { wait_ms: 0 });
  out.default_idle = idle.delivery === null || idle.delivery === undefined;
  const { delivery } = await unary("NextJob", { wait_ms: 0, lease_ms: 10000, queues: ["node-q"] });
  out.claimed = { id: delivery.task.id, queue: delivery.task.queue, priority: delivery.task.priority };
  const extended = await unary("ExtendLease", {
    id: delivery.task.id,
    lease_id: delivery.lease_id,
    lease_ms: 120000,
  });
  out.extended_deadline_s = Number(extended.deadline.seconds);
  await unary("Ack", { id: delivery.task.id, lease_id: delivery.lease_id });
  const listed = await unary("ListQueues", {});
  out.queues = listed.queues.map((q) => ({ name: q.name, ready: q.ready, paused: q.paused }));

  // A stream on node-q: extend the one task on the stream, ack it, drain, and wait for the end.
  out.stream = await new Promise((resolve, reject) => {
    const seen = { received: [], settled: [], drained: null, ended: false };
    const call = client.StreamJobs();
    call.on("data", (response) => {
      for (const s of response.settled) {
        seen.settled.push({
          id: s.id,
          code: s.code,
          extend: s.extend,
          deadline_s: s.deadline ? Number(s.deadline.seconds) : null,
        });
        if (s.extend) {
          call.write({ acks: [{ id: s.id, lease_id: s.lease_id }] });
        } else {
          call.write({ drain: true });
        }
      }
      for (const d of response.deliveries) {
        seen.received.push({ id: d.task.id, queue: d.task.queue });
        call.write({ extends: [{ id: d.task.id, lease_id: d.lease_id, lease_ms: 90000 }] });
      }
      if (response.drained) seen.drained = { unsettled: response.drained.unsettled };
    });
    call.on("status", (status) => {
      seen.status = status.code;
      call.end();
      resolve(seen);
    });
    call.on("error", reject);
    call.write({ open: { prefetch: 2, lease_ms: 30000, queues: ["node-q"] } });
  });
  return out;
}

if (opts.queues) result.queues = await queues();

result.stats = await unary("Stats", {});
client.close();
console.log(JSON.stringify(result));
