// A chat page on the AI SDK's useChat, with the broker as its backend.
import { useChat } from "@ai-sdk/react";
import { DefaultChatTransport } from "ai";
import { useState } from "react";
import { createRoot } from "react-dom/client";

const query = new URLSearchParams(location.search);
// The chat id outlives a reload (it is kept for the tab), so the page resumes its answer.
const chatId = query.get("chat") ?? sessionStorage.getItem("chat") ?? `chat-${crypto.randomUUID()}`;
sessionStorage.setItem("chat", chatId);
// The simulated model's knobs (docs/providers.md); a real model needs none of this.
const simulate = JSON.parse(query.get("simulate") ?? '{"tokens": 120, "tokens_per_s": 15}');

const transport = new DefaultChatTransport({
  api: "/v1/ui/chat",
  body: { params: { simulate } },
});

function textOf(message) {
  return message.parts.filter((part) => part.type === "text").map((part) => part.text).join("");
}

function App() {
  const { messages, sendMessage, status, stop, error } = useChat({
    id: chatId,
    transport,
    resume: true,
  });
  const [input, setInput] = useState("");
  const busy = status === "submitted" || status === "streaming";

  function submit(event) {
    event.preventDefault();
    if (!input.trim() || busy) return;
    sendMessage({ text: input });
    setInput("");
  }

  function stopAnswer() {
    // Closing the tab is not a stop: the broker stops only when asked.
    fetch(`/v1/ui/chat/${encodeURIComponent(chatId)}/stop`, { method: "POST" });
    stop();
  }

  return (
    <main data-status={status}>
      <h1>useChat on the broker</h1>
      {messages.map((message) => (
        <article key={message.id} data-id={message.id} data-role={message.role}>
          <b>{message.role === "user" ? "You" : "Model"}: </b>
          <span className="text">{textOf(message)}</span>
        </article>
      ))}
      {error && <p role="alert">{error.message}</p>}
      <form onSubmit={submit}>
        <input value={input} onChange={(e) => setInput(e.target.value)} placeholder="Ask" />
        <button type="submit" disabled={busy}>Send</button>
        <button type="button" onClick={stopAnswer} disabled={!busy}>Stop</button>
      </form>
    </main>
  );
}

createRoot(document.getElementById("root")).render(<App />);
