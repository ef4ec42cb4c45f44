import typer
app = typer.Typer()
@app.command()
def doctor():
    print("ok")
def main():
    app()
