// Streams one chat completion with tools through the official `openai` Node SDK and prints the
// answer put together from its deltas, as JSON: {content, calls: [[name, arguments]], finish}.
// Usage: node tool_stream.mjs BASE_URL MODEL TOOLS_JSON MESSAGES_JSON
import OpenAI from "openai";

const [baseURL, model, tools, messages] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 120000 });
const stream = await client.chat.completions.create({
  model, tools: JSON.parse(tools), messages: JSON.parse(messages), stream: true, temperature: 0, max_tokens: 160,
});
let content = "";
let finish = null;
const calls = [];
for await (const chunk of stream) {
  const choice = chunk.choices[0];
  if (!choice) continue;
  finish = choice.finish_reason ?? finish;
  if (choice.delta.content) content += choice.delta.content;
  for (const t of choice.delta.tool_calls ?? []) {
    if (!calls[t.index]) {
      if (!t.id || !t.function?.name) throw new Error("a call's first delta has no id or name");
      calls[t.index] = [t.function.name, ""];
    }
    calls[t.index][1] += t.function?.arguments ?? "";
  }
}
console.log(JSON.stringify({ content, calls, finish }));
