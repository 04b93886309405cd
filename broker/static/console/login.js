// The login page: posts the admin token, or an admin user's name and password, as JSON (the server sets an HttpOnly session cookie
// and answers the session's header value, kept in this origin's localStorage for console.js), then
// opens the console. The token is not stored anywhere in the browser.
"use strict";
// the default token file is one per admin port: name this one's
document.getElementById("token-file").textContent =
  `~/.flowbroker/admin-token-${window.location.port || (window.location.protocol === "https:" ? 443 : 80)}`;
document.getElementById("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("login-error");
  error.textContent = "";
  const token = document.getElementById("token").value;
  const username = document.getElementById("username").value;
  const password = document.getElementById("password").value;
  try {
    const response = await fetch("/login", {
      method: "POST",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify(username ? {username, password} : {token}),
      credentials: "same-origin",
    });
    if (response.ok) {
      const answer = await response.json();
      window.localStorage.setItem("flowbroker-csrf", answer.csrf);
      window.location.assign("/");
      return;
    }
    const text = await response.text().catch(() => "");
    let body = null;
    try { body = JSON.parse(text); } catch (e) { body = null; }
    const line = text.trim().split("\n")[0].slice(0, 200);  // the admin port's own 503 is a line of text
    error.textContent = body && body.error ? body.error.message : (line ? `HTTP ${response.status}: ${line}` : `HTTP ${response.status}`);
  } catch (e) {
    error.textContent = `cannot reach the broker: ${e}`;
  }
});
