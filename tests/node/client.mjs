// A wq gRPC worker in Node.js, built only from the project's .proto with @grpc/grpc-js and
// @grpc/proto-loader: the proof that workers in any language can use wq.
//
//   node client.mjs HOST:PORT [--enqueue N] [--consume M] [--prefetch P] [--fail-first]
//
// Enqueues N tasks (unary Enqueue), then consumes M tasks over the StreamJobs stream, acking each
// on the stream (or, with --fail-first, nacking the first delivery), and prints one JSON line with
// what happened.
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
    else throw new Error(`unknown argument ${a}`);
  }
  if (!opts.target) throw new Error("usage: client.mjs HOST:PORT [--enqueue N] [--consume M]");
  return opts;
}

const opts = parseArgs(process.argv.slice(2));
const definition = protoLoader.loadSync("wqclient/pb/broker.proto", {
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

if (opts.consume > 0) {
  await new Promise((resolve, reject) => {
    const call = client.StreamJobs();
    let unfinished = 0;
    let settledCount = 0;
    let failed = false;
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
      if (settledCount >= opts.consume) {
        // Stop the pushes before ending, so no task is sent to a worker that is leaving.
        call.write({ drain: true });
        call.end();
      }
    });
    call.on("end", resolve);
    call.on("error", reject);
    call.write({ open: { prefetch: opts.prefetch, lease_ms: 60000 } });
  });
}

result.stats = await unary("Stats", {});
client.close();
console.log(JSON.stringify(result));
