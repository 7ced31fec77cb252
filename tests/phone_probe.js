(function () {
  const W = document.documentElement.clientWidth, bad = [];
  const skip = new Set(["TITLE", "STYLE", "SCRIPT", "HEAD", "HTML"]);
  for (const el of document.querySelectorAll("body *")) {
    if (skip.has(el.tagName.toUpperCase())) continue;
    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    if (!own) continue;
    let px = parseFloat(getComputedStyle(el).fontSize);
    const svg = el.closest("svg");
    if (svg) px *= svg.getScreenCTM().a;
    if (px < 11) bad.push("text " + px.toFixed(1) + "px: " + el.textContent.trim().slice(0, 30));
  }
  for (const t of document.querySelectorAll("table, svg")) {
    const box = t.parentElement, r = t.getBoundingClientRect();
    const scrolls = ["auto", "scroll"].includes(getComputedStyle(box).overflowX);
    const right = box.getBoundingClientRect().right;
    if (r.right > W + 0.5 && !(scrolls && right <= W + 0.5)) bad.push("cut off: " + t.tagName);
  }
  if (document.documentElement.scrollWidth > W + 0.5) bad.push("page wider than the screen");
  const out = document.createElement("pre");
  out.id = "probe";
  const shown = [...document.querySelectorAll("table, svg")].filter(e => {
    const r = e.getBoundingClientRect();
    return r.width > 0 && r.height > 0;
  }).length;
  out.textContent = JSON.stringify({width: W, bad: bad, shown: shown});
  document.body.appendChild(out);
})();
