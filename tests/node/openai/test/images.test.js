// The official openai Node SDK asks an image question on both OpenAI doors: the simulated
// provider opens its answer by naming the images it was shown, proof that they reached it; a
// file_id, which this broker has no files API for, is a 400 naming input.
// BROKER_URL names a live broker (the pytest test tests/test_openai_node.py starts one).
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";

const base = process.env.BROKER_URL;
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });

// A 1x1 PNG.
const png =
  "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
const cat = "https://images.example.com/cat.jpg";
const broker = { params: { simulate: { tokens: 4, tokens_per_s: 0 } } };

test("a chat completion answers a question with an image", async () => {
  const completion = await client.chat.completions.create({
    model: "simulated",
    messages: [
      {
        role: "user",
        content: [
          { type: "text", text: "What is in this picture?" },
          { type: "image_url", image_url: { url: cat, detail: "low" } },
        ],
      },
    ],
    broker,
  });
  const text = completion.choices[0].message.content;
  assert.ok(text.startsWith("(shown 1 image: images.example.com) "), text);
});

test("a response answers a question with images, and a file_id is a 400", async () => {
  const response = await client.responses.create({
    model: "simulated",
    input: [
      {
        role: "user",
        content: [
          { type: "input_text", text: "What is in these pictures?" },
          { type: "input_image", image_url: png, detail: "high" },
          { type: "input_image", image_url: cat, detail: "auto" },
        ],
      },
    ],
    broker,
  });
  assert.equal(response.status, "completed");
  assert.ok(
    response.output_text.startsWith("(shown 2 images: image/png, images.example.com) "),
    response.output_text,
  );
  await assert.rejects(
    client.responses.create({
      model: "simulated",
      input: [
        { role: "user", content: [{ type: "input_image", file_id: "file-1", detail: "auto" }] },
      ],
    }),
    (error) => {
      assert.equal(error.status, 400);
      assert.equal(error.param, "input");
      assert.match(error.message, /file_id/);
      return true;
    },
  );
});
