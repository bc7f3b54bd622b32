"""Agents written with the OpenAI client, shipped as examples (`task.agent: hybridrl.gateway.examples.X:run`)."""
