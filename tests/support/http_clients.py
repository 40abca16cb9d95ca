"""The official clients talking to an app in process (ASGI transport), and the scripted tool-calling app the tool,
Responses and Messages tests share."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import openai

from cluster.http_api.ingress import build_app
from cluster.http_api.tool_parsers import DSML
from cluster.serve_settings import IngressSettings
from support.http_fakes import INFO, ScriptedEngine, write_deepseek_checkpoint

# A DeepSeek-V3.2 answer that calls get_weather(city="Paris", days=2) after some text, in DSML
DSML_CALL = [" I will check.", "\n\n", f"<{DSML}function_calls>\n<{DSML}invoke name=", '"get_weather">\n',
             f'<{DSML}parameter name="city" string="true">Paris</{DSML}', "parameter>\n",
             f'<{DSML}parameter name="days" string="false">2</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}function_calls>']
WIDE = dataclasses.replace(INFO, max_model_len=4096)  # room for the tools section


def run_openai(app, scenario, timeout: float = 120):
    """`scenario(client)`'s result, the openai client talking to `app` in process."""
    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=timeout)
        return await scenario(openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http,
                                                 max_retries=0))

    return asyncio.run(main())


def scripted_tool_app(folder: Path, script: list[str] = DSML_CALL):
    """(engine, app, tokenizer): a DeepSeek-V3.2 checkpoint folder whose engine answers `script`, served with the
    deepseek_v32 tool-call parser (auto tool choice on) and the deepseek_v3 reasoning parser."""
    folder, tokenizer = write_deepseek_checkpoint(folder)
    engine = ScriptedEngine(script, info=WIDE)
    settings = IngressSettings(model_dir=str(folder), tool_call_parser="deepseek_v32", enable_auto_tool_choice=True,
                               reasoning_parser="deepseek_v3")
    return engine, build_app(engine, settings), tokenizer
