#!/usr/bin/env node
// A hostile MCP server for tests/mcp.rs, over stdio (newline-delimited JSON-RPC, no
// dependencies): its tools return 100 MB, hang, crash the process, write a malformed frame,
// fail, and one has a 1 MB schema. smolchat must list the sane ones, leave out the 1 MB
// schema, and end each bad call with an error the model reads, never a broken reply.
const readline = require("readline");

const tool = (name, description, extra) => ({
  name,
  description,
  inputSchema: { type: "object", properties: {}, additionalProperties: false, ...(extra || {}) },
});
const tools = [
  tool("big", "Returns 100 MB of text."),
  tool("hang", "Never answers."),
  tool("crash", "Ends the server's process."),
  tool("garbage", "Writes a malformed frame."),
  tool("fails", "Answers with a tool error."),
  tool("hello", "Answers hello."),
  tool("huge_schema", "Has a 1 MB argument schema.", {
    properties: { x: { type: "string", description: "a".repeat(1024 * 1024) } },
  }),
];

const send = (msg) => process.stdout.write(JSON.stringify(msg) + "\n");
const text = (t, isError) => ({ content: [{ type: "text", text: t }], isError: !!isError });

const rl = readline.createInterface({ input: process.stdin });
rl.on("line", (line) => {
  let msg;
  try {
    msg = JSON.parse(line);
  } catch (_) {
    return;
  }
  if (msg.id === undefined) return; // a notification
  const reply = (result) => send({ jsonrpc: "2.0", id: msg.id, result });
  switch (msg.method) {
    case "initialize":
      return reply({
        protocolVersion: (msg.params && msg.params.protocolVersion) || "2025-06-18",
        capabilities: { tools: {} },
        serverInfo: { name: "hostile", version: "1.0.0" },
      });
    case "ping":
      return reply({});
    case "tools/list":
      return reply({ tools });
    case "tools/call": {
      const name = msg.params && msg.params.name;
      if (name === "big") return reply(text("x".repeat(100 * 1024 * 1024)));
      if (name === "hang") return;
      if (name === "crash") process.exit(3);
      if (name === "garbage") {
        process.stdout.write("{this is not a frame\n");
        return;
      }
      if (name === "fails") return reply(text("it went wrong on purpose", true));
      if (name === "hello") return reply(text("hello from the hostile server"));
      return send({ jsonrpc: "2.0", id: msg.id, error: { code: -32602, message: "no such tool" } });
    }
    default:
      return send({ jsonrpc: "2.0", id: msg.id, error: { code: -32601, message: "not found" } });
  }
});
