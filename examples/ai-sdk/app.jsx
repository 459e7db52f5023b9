// A chat page on the AI SDK's useChat, with the broker as its backend.
import { useChat } from "@ai-sdk/react";
import {
  DefaultChatTransport,
  lastAssistantMessageIsCompleteWithApprovalResponses,
  lastAssistantMessageIsCompleteWithToolCalls,
} from "ai";
import { useState } from "react";
import { createRoot } from "react-dom/client";

const query = new URLSearchParams(location.search);
// The chat id outlives a reload (it is kept for the tab), so the page resumes its answer.
const chatId = query.get("chat") ?? sessionStorage.getItem("chat") ?? `chat-${crypto.randomUUID()}`;
sessionStorage.setItem("chat", chatId);
// The simulated model's knobs (docs/providers.md); a real model needs none of this.
const simulate = JSON.parse(query.get("simulate") ?? '{"tokens": 120, "tokens_per_s": 15}');

// A tool that runs here, in the browser: the broker streams the model's calls to it, and the
// chat sends the outputs back by itself (docs/aisdk.md, Client tools).
const tools = {
  local_time: {
    description: "The user's local time and time zone",
    inputSchema: { type: "object", properties: {} },
  },
};
const done = new Map(); // call id -> output: a call handed over again never runs twice

function localTime() {
  const zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
  return { time: new Date().toLocaleTimeString(), zone };
}

const transport = new DefaultChatTransport({
  api: "/v1/ui/chat",
  body: { tools },
  // The simulated model calls tools only where the knobs script it: when the user asks, not
  // when the outputs come back (a real model decides by itself).
  prepareSendMessagesRequest: ({ id, messages, body, trigger, messageId }) => {
    const asking = messages.at(-1).role === "user";
    const knobs = asking ? simulate : { ...simulate, tool_calls: undefined };
    return { body: { ...body, id, messages, trigger, messageId, params: { simulate: knobs } } };
  },
});

function textOf(message) {
  return message.parts.filter((part) => part.type === "text").map((part) => part.text).join("");
}

// The chat goes on by itself once every client call has its output, or once a person answered
// every tool call that waits for approval (a server tool's rule, docs/tools.md, Approvals).
const sendAutomaticallyWhen = (chat) =>
  lastAssistantMessageIsCompleteWithToolCalls(chat)
  || lastAssistantMessageIsCompleteWithApprovalResponses(chat);

function ToolPart({ part, answer }) {
  const name = part.type.slice(5);
  if (part.state === "approval-requested") {
    // The request lives in the broker: a reload or another device shows it again.
    return (
      <span className="tool" data-state={part.state}>
        {name} {JSON.stringify(part.input)}?{" "}
        <button type="button" onClick={() => answer(part.approval.id, true)}>Allow</button>
        <button type="button" onClick={() => answer(part.approval.id, false)}>Deny</button>{" "}
      </span>
    );
  }
  const shown = part.state === "output-available" ? JSON.stringify(part.output)
    : part.state === "output-denied" ? "denied" : "…";
  return <code className="tool" data-state={part.state}>{name}: {shown} </code>;
}

function App() {
  const { messages, sendMessage, addToolOutput, addToolApprovalResponse, status, stop, error } = useChat({
    id: chatId,
    transport,
    resume: true,
    sendAutomaticallyWhen,
    onToolCall({ toolCall }) {
      if (toolCall.toolName !== "local_time") return;
      if (!done.has(toolCall.toolCallId)) done.set(toolCall.toolCallId, localTime());
      addToolOutput({ tool: "local_time", toolCallId: toolCall.toolCallId,
                      output: done.get(toolCall.toolCallId) });
    },
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
          {message.parts.filter((part) => part.type.startsWith("tool-")).map((part) => (
            <ToolPart key={part.toolCallId} part={part}
                      answer={(id, approved) => addToolApprovalResponse({ id, approved })} />
          ))}
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
