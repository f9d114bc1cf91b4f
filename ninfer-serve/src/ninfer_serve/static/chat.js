// The chat page: a conversation kept in this page, streamed from /v1/chat/completions.
//
// Model text reaches the DOM only as textContent (the user's messages, the thinking section) or through
// renderMarkdown, which escapes all of it. The API key lives in sessionStorage and is sent as a Bearer token.
// Each assistant message element carries data-state: "streaming", then "done", "stopped" or "error", and its
// content element data-chars, the length of the answer's markdown source so far, so a reader (or a test) can
// tell where it stands (the rendered text can shrink as markup closes).

import { renderMarkdown } from "./markdown.js";

const KEY_STORE = "ninfer-api-key";
const $ = (id) => document.getElementById(id);

const state = {
  messages: [],        // {role, content}: what is sent as the conversation
  model: null,
  controller: null,    // AbortController of the request in flight
};

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

// The message of an error body in OpenAI's shape ({"error": {"message": ...}}), else the status line.
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`.trim();
}

function askForKey(message) {
  showError(message);
  $("key-form").hidden = false;
  $("api-key").focus();
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    askForKey(await errorMessage(response));
    return false;
  }
  if (!response.ok) {
    showError(await errorMessage(response));
    return false;
  }
  const body = await response.json();
  state.model = body.data && body.data.length ? body.data[0].id : null;
  $("model").textContent = state.model || "(no model)";
  showError("");
  return true;
}

function addUserMessage(text) {
  const el = document.createElement("div");
  el.className = "message user";
  el.textContent = text;
  $("conversation").append(el);
}

function addAssistantMessage() {
  const el = document.createElement("div");
  el.className = "message assistant";
  el.dataset.state = "streaming";
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  thinking.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thinkingText = document.createElement("div");
  thinkingText.className = "thinking-text";
  thinking.append(summary, thinkingText);
  const content = document.createElement("div");
  content.className = "content";
  const status = document.createElement("div");
  status.className = "status";
  status.textContent = "…";
  el.append(thinking, content, status);
  $("conversation").append(el);
  return { el, thinking, thinkingText, content, status, reasoning: "", text: "" };
}

function settle(view, outcome, note) {
  view.el.dataset.state = outcome;
  view.el.classList.add(outcome === "done" ? "done" : outcome === "stopped" ? "stopped" : "failed");
  view.status.textContent = note;
  view.thinking.open = false;
}

function requestBody() {
  const body = {
    model: state.model,
    messages: state.messages,
    stream: true,
    chat_template_kwargs: { enable_thinking: $("thinking").checked },
  };
  const numbers = [["temperature", "temperature", parseFloat], ["top-p", "top_p", parseFloat],
                   ["max-tokens", "max_tokens", (v) => parseInt(v, 10)]];
  for (const [id, field, parse] of numbers) {
    const value = $(id).value.trim();
    if (value !== "") body[field] = parse(value);
  }
  return body;
}

// Server-sent events from a fetch body: calls onData with each event's data (joined data lines).
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data && onData(data) === false) return;
    }
  }
}

async function send(text) {
  showError("");
  state.messages.push({ role: "user", content: text });
  addUserMessage(text);
  const view = addAssistantMessage();
  const controller = new AbortController();
  state.controller = controller;
  $("send").disabled = true;
  $("stop").disabled = false;
  let finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) {
      const message = await errorMessage(response);
      state.messages.pop();   // the turn did not happen; the text goes back in the box to send again
      $("prompt").value = text;
      if (response.status === 401) askForKey(message); else showError(message);
      settle(view, "error", `error ${response.status}`);
      return;
    }
    let streamError = null;
    await readEvents(response, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        streamError = chunk.error.message || "the server ended the stream with an error";
        return false;
      }
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const reasoning = delta.reasoning_content ?? delta.reasoning;
        if (reasoning) {
          view.reasoning += reasoning;
          view.thinking.hidden = false;
          if (!view.text) view.thinking.open = true;
          view.thinkingText.textContent = view.reasoning;
        }
        if (delta.content) {
          view.text += delta.content;
          view.thinking.open = false;
          view.content.innerHTML = renderMarkdown(view.text);
          view.content.dataset.chars = String(view.text.length);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      return true;
    });
    state.messages.push({ role: "assistant", content: view.text });
    if (streamError) {
      showError(streamError);
      settle(view, "error", "error");
    } else {
      settle(view, "done", finish === "length" ? "stopped at the token limit" : "");
    }
  } catch (err) {
    if (err.name === "AbortError") {
      // Keep what arrived: the conversation goes on from the partial answer.
      state.messages.push({ role: "assistant", content: view.text });
      settle(view, "stopped", "stopped");
    } else {
      state.messages.pop();
      showError(`request failed: ${err.message}`);
      settle(view, "error", "error");
    }
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function wire() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
  });
  $("new-chat").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    $("conversation").replaceChildren();
    showError("");
  });
  $("key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    $("api-key").value = "";
    if (await loadModel()) $("key-form").hidden = true;
  });
}

wire();
loadModel().catch((err) => showError(`cannot reach the server: ${err.message}`));
