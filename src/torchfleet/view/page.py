"""The one page both views show: the plotly charts of figures.py (CHARTS), the verdicts' lines, a status line.

The live page (`--dashboard`) loads plotly.js from its server and asks the
server's figures.json for the charts every POLL_MS, passing the version it
holds (the server answers 204 while nothing is new). The report's page
carries plotly.js and the charts inside the file, so it opens offline and
from a file:// address. Either way the page's own script only hands
plotly's figure JSON to Plotly.react; the text it shows goes in through
textContent, so a host name or a message is never read as HTML.
"""

from __future__ import annotations

import html

from torchfleet.view.figures import CHARTS

POLL_MS = 2000

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1rem 2rem; color: #222; }
h1 { font-size: 1.3rem; margin-bottom: 0.2rem; }
#status { color: #555; margin-bottom: 1rem; }
#charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(560px, 1fr)); gap: 1rem; }
#verdicts li { color: #b00; font-family: ui-monospace, monospace; font-size: 0.9rem; }
"""

# Hands each figure to plotly and the lines to the list; with a poll address, asks again every POLL_MS.
_SCRIPT = """
let version = -1;
function draw(payload) {
  for (const [id, fig] of Object.entries(payload.figures)) {
    Plotly.react(id, fig.data, fig.layout, {responsive: true, displayModeBar: false});
  }
  const list = document.getElementById("verdicts");
  list.replaceChildren(...payload.verdicts.map((line) => {
    const item = document.createElement("li");
    item.textContent = line;
    return item;
  }));
  document.getElementById("status").textContent = payload.status;
}
async function poll(url) {
  try {
    const answer = await fetch(url + "?version=" + version, {cache: "no-store"});
    if (answer.status === 200) {
      version = Number(answer.headers.get("X-Version"));
      draw(await answer.json());
    }
  } catch (error) {
    document.getElementById("status").textContent = "the run's server does not answer (" + error + ")";
  }
  setTimeout(() => poll(url), POLL_MS);
}
"""


def page(title: str, plotly_js: str, start: str) -> str:
    """The page's HTML: `plotly_js` a <script> that loads plotly.js, `start` the script that draws."""
    charts = "\n".join(f'<div id="{name}" class="chart"></div>' for name in CHARTS)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>{_STYLE}</style>
{plotly_js}
</head>
<body>
<h1>{html.escape(title)}</h1>
<div id="status">loading</div>
<div id="charts">
{charts}
</div>
<h2>Stragglers named</h2>
<ul id="verdicts"></ul>
<script>{_SCRIPT}
{start}
</script>
</body>
</html>
"""


def live_page(title: str) -> str:
    """The --dashboard page: plotly.js and the figures from the server that serves it."""
    return page(title, '<script src="plotly.min.js"></script>', 'poll("figures.json");')


def static_page(title: str, payload_json: str) -> str:
    """The report: plotly.js and the figures inside the file (about 5 MB, plotly.js most of it)."""
    from plotly.offline import get_plotlyjs

    # "</" would end the script element early inside JSON text; "<\\/" is the same string to JSON.
    data = payload_json.replace("</", "<\\/")
    return page(title, f"<script>{get_plotlyjs()}</script>", f"draw({data});")
