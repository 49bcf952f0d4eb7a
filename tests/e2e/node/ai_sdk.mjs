// The Vercel AI SDK's `openai(model)` (the Responses API) against the proxy: one turn with
// `generateText` or `streamText`, optionally a client tool and later turns that send the
// conversation so far back (`followUp`, or a list of them: `followUps`). Prints one JSON
// object: what the SDK made of each turn.
//
//   node ai_sdk.mjs '{"baseURL": "...", "model": "stock", "mode": "generate", "prompt": "...",
//                     "clientTool": true, "store": false, "followUp": "And now?",
//                     "followUps": ["More?", "And more?"], "turns": {"count": 60, "bytes": 4000}}'
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, stepCountIs, streamText, tool } from 'ai';
import { z } from 'zod';

const scenario = JSON.parse(process.argv[2]);
const warnings = [];
globalThis.AI_SDK_LOG_WARNINGS = (options) => warnings.push(...options.warnings);

const openai = createOpenAI({ baseURL: scenario.baseURL, apiKey: 'sk-e2e' });
const asked = [];
const tools = scenario.clientTool
  ? {
      ask_user: tool({
        description: 'Ask the user a question.',
        inputSchema: z.object({ question: z.string() }),
        execute: async ({ question }) => {
          asked.push(question);
          return 'the user approves';
        },
      }),
    }
  : undefined;
const providerOptions = scenario.store === undefined ? undefined : { openai: { store: scenario.store } };

function describeStep(step) {
  return step.content.map((part) => ({
    type: part.type,
    toolName: part.toolName,
    providerExecuted: part.providerExecuted ?? false,
    input: part.input,
    output: part.output,
    text: part.text,
  }));
}

async function turn(request) {
  const args = { model: openai(scenario.model), tools, stopWhen: stepCountIs(5), providerOptions, ...request };
  if (scenario.mode === 'stream') {
    const errors = [];
    const result = streamText({ ...args, onError: ({ error }) => errors.push(String(error)) });
    const parts = [];
    for await (const part of result.fullStream) parts.push(part.type);
    const steps = await result.steps;
    return {
      text: await result.text,
      steps: steps.map(describeStep),
      parts,
      errors,
      response: await result.response,
    };
  }
  const result = await generateText(args);
  return { text: result.text, steps: result.steps.map(describeStep), response: result.response };
}

// `turns: {count, bytes}`: that many turns of `Turn <n>: ` and `bytes` x's (a long conversation).
if (scenario.turns) {
  const texts = Array.from({ length: scenario.turns.count }, (_, n) => `Turn ${n}: ` + 'x'.repeat(scenario.turns.bytes));
  [scenario.prompt, ...scenario.followUps] = texts;
}
const first = await turn({ prompt: scenario.prompt });
const report = { text: first.text, steps: first.steps, parts: first.parts, errors: first.errors };
// Each follow-up turn sends the whole conversation so far, as an app built on the SDK keeps it.
const messages = [{ role: 'user', content: scenario.prompt }, ...first.response.messages];
report.followUps = [];
for (const text of scenario.followUps ?? (scenario.followUp ? [scenario.followUp] : [])) {
  messages.push({ role: 'user', content: text });
  const next = await turn({ messages });
  messages.push(...next.response.messages);
  report.followUp = { text: next.text, steps: next.steps, parts: next.parts, errors: next.errors };
  report.followUps.push(next.text);
}
report.asked = asked;
report.warnings = warnings;
console.log(JSON.stringify(report));
