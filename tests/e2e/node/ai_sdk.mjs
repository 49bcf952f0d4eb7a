// The Vercel AI SDK's `openai(model)` (the Responses API) against the proxy: one turn with
// `generateText` or `streamText`, optionally a client tool and a second turn that sends the
// first turn's messages back. Prints one JSON object: what the SDK made of each turn.
//
//   node ai_sdk.mjs '{"baseURL": "...", "model": "stock", "mode": "generate", "prompt": "...",
//                     "clientTool": true, "store": false, "followUp": "And now?"}'
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

const first = await turn({ prompt: scenario.prompt });
const report = { text: first.text, steps: first.steps, parts: first.parts, errors: first.errors };
if (scenario.followUp) {
  const messages = [
    { role: 'user', content: scenario.prompt },
    ...first.response.messages,
    { role: 'user', content: scenario.followUp },
  ];
  const second = await turn({ messages });
  report.followUp = { text: second.text, steps: second.steps, parts: second.parts, errors: second.errors };
}
report.asked = asked;
report.warnings = warnings;
console.log(JSON.stringify(report));
