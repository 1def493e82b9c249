// celery-zdelay dashboard: local times, live overview, form helpers.
// No framework and no third-party code; the server renders (and escapes) all
// HTML, this file only swaps a server-rendered fragment in and formats dates.
"use strict";

function localTimes(root) {
  // Show each due time in the browser's own zone next to the UTC one.
  root.querySelectorAll("time[data-ms]").forEach(function (el) {
    var when = new Date(Number(el.dataset.ms));
    var text = when.toLocaleString(undefined, { timeZoneName: "short" });
    if (el.classList.contains("local")) {
      el.textContent = text;
    } else {
      el.title = text;
    }
  });
}

function refreshOverview() {
  var box = document.getElementById("overview");
  if (!box) return;
  setInterval(function () {
    fetch(box.dataset.refresh, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) {
        // The fragment comes from our own server, rendered with autoescaping.
        box.innerHTML = html;
        localTimes(box);
        box.dataset.refreshed = String(Date.now());
      })
      .catch(function () { box.classList.add("stale"); });
  }, 5000);
}

function formHelpers() {
  document.querySelectorAll(".select-all").forEach(function (all) {
    all.addEventListener("change", function () {
      all.closest("form").querySelectorAll('input[name="ids"]').forEach(function (box) {
        box.checked = all.checked;
      });
    });
  });
  document.querySelectorAll("form").forEach(function (form) {
    form.addEventListener("submit", function (event) {
      var button = event.submitter;
      if (button && button.dataset.confirm && !window.confirm(button.dataset.confirm)) {
        event.preventDefault();
        return;
      }
      // A date picked in the browser's zone travels as an absolute UTC time.
      var local = form.querySelector(".local-eta");
      var eta = form.querySelector('input[name="eta"]');
      if (local && eta) {
        eta.value = local.value ? new Date(local.value).toISOString() : "";
      }
    });
  });
}

document.addEventListener("DOMContentLoaded", function () {
  localTimes(document);
  refreshOverview();
  formHelpers();
});
